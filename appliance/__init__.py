"""Offline voice appliance for the Raspberry Pi 5.

Hears with a GGUF model through llama.cpp (Gemma 4 E2B natively hears 16 kHz audio), answers with
Piper TTS, and stops talking the moment the user starts (Silero VAD barge-in).
"""

__version__ = "0.1.0"
