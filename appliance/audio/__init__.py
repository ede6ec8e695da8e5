"""Audio sources and sinks behind one interface (``port``: :class:`~appliance.audio.port.AudioPort`):
real sound devices (``device``), the simulated room (``room``), the null port; the one fader they share
(``fader``); echo cancellation (``echo``) and the echo's delay behind the far end (``delay``); and audio-file helpers
(``files``)."""
