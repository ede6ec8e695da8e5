"""Audio sources and sinks: real sound devices (``devices``), the simulated room (``room``), echo
cancellation (``echo``), and audio-file helpers (``files``)."""
