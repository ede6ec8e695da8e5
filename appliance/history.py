"""The conversation history on disk: SQLite in WAL mode, so a pulled plug loses at most the turn being
written (SQLite's WAL journal is atomic per transaction, https://www.sqlite.org/wal.html).

One table, ``messages(id, role, text, audio_path, created_s)``; roles are ``user`` and ``model``. The
user's audio of a turn is kept as a 16 kHz WAV beside the database when ``keep_audio`` is on, so a model
that hears can re-hear it when its cache is rebuilt; a model reply is always text.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .errors import UserError

SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    role TEXT NOT NULL CHECK (role IN ('user', 'model')),
    text TEXT NOT NULL,
    audio_path TEXT,
    created_s REAL NOT NULL
);
"""


@dataclass
class StoredMessage:
    id: int
    role: str
    text: str
    audio_path: Optional[str]


class HistoryStore:
    """Append-only log of the conversation, pruned from the front.

    :param state_dir: directory for ``history.sqlite3`` and ``audio/`` (created if missing).
    :param keep_audio: store the user's audio of each turn as a WAV.
    :raises UserError: the directory cannot be created or the database cannot be opened.
    """

    def __init__(self, state_dir: str | Path, keep_audio: bool = True):
        self.dir = Path(state_dir)
        self.keep_audio = keep_audio
        try:
            (self.dir / "audio").mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(self.dir / "history.sqlite3"), check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")  # fsync at each commit: the turn survives a power cut
            self.db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise UserError(f"{self.dir}: cannot open the history database ({exc}); check storage.state_dir "
                            "in config.yaml and that the service may write there") from None
        self._lock = threading.Lock()

    def append(self, role: str, text: str, audio: Optional[np.ndarray] = None) -> int:
        """Store one message (and its 16 kHz float32 audio if given and kept). Returns its id."""
        path = None
        if audio is not None and self.keep_audio and len(audio):
            from .audio.files import write_wav

            p = self.dir / "audio" / f"{int(time.time())}-{uuid.uuid4().hex[:8]}.wav"
            write_wav(p, audio, 16000)
            path = str(p)
        with self._lock:
            cur = self.db.execute("INSERT INTO messages (role, text, audio_path, created_s) VALUES (?, ?, ?, ?)",
                                  (role, text, path, time.time()))
            return int(cur.lastrowid)

    def messages(self) -> list[StoredMessage]:
        with self._lock:
            rows = self.db.execute("SELECT id, role, text, audio_path FROM messages ORDER BY id").fetchall()
        return [StoredMessage(*r) for r in rows]

    def drop_through(self, message_id: int) -> None:
        """Delete every message up to and including ``message_id`` (and their audio files)."""
        with self._lock:
            rows = self.db.execute("SELECT audio_path FROM messages WHERE id <= ? AND audio_path IS NOT NULL",
                                   (message_id,)).fetchall()
            self.db.execute("DELETE FROM messages WHERE id <= ?", (message_id,))
        for (p,) in rows:
            Path(p).unlink(missing_ok=True)

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self.db.execute("DELETE FROM messages")
        for p in (self.dir / "audio").glob("*.wav"):
            p.unlink(missing_ok=True)

    def close(self) -> None:
        self.db.close()
