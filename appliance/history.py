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
        path = self._write_audio(audio)
        with self._lock:
            cur = self.db.execute("INSERT INTO messages (role, text, audio_path, created_s) VALUES (?, ?, ?, ?)",
                                  (role, text, path, time.time()))
            return int(cur.lastrowid)

    def append_exchange(self, user_text: str, user_audio: Optional[np.ndarray], model_text: str) -> tuple[int, int]:
        """Store a user turn and the reply to it in ONE transaction, so that a kill or a power cut keeps
        both or neither (the user's audio WAV is written first; an orphaned WAV is harmless).

        :param user_audio: float32 16 kHz mono, or None; written only when ``keep_audio`` is on.
        :returns: ``(user_id, model_id)``.
        """
        path = self._write_audio(user_audio)
        now = time.time()
        sql = "INSERT INTO messages (role, text, audio_path, created_s) VALUES (?, ?, ?, ?)"
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                uid = self.db.execute(sql, ("user", user_text, path, now)).lastrowid
                mid = self.db.execute(sql, ("model", model_text, None, now)).lastrowid
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        return int(uid), int(mid)

    def restore(self) -> list[StoredMessage]:
        """The stored conversation as whole exchanges: a user message followed by its reply, alternating.

        A history that does not alternate (left by an older version that committed the two rows
        separately and was killed between them) is repaired: every message that is not part of a
        user → model pair is deleted from the database, with one warning in the log.

        :returns: the messages kept, oldest first, ``[user, model, user, model, ...]``.
        """
        rows = self.messages()
        kept: list[StoredMessage] = []
        stray: list[StoredMessage] = []
        i = 0
        while i < len(rows):
            if rows[i].role == "user" and i + 1 < len(rows) and rows[i + 1].role == "model":
                kept += rows[i : i + 2]
                i += 2
            else:
                stray.append(rows[i])
                i += 1
        if stray:
            import logging

            logging.getLogger(__name__).warning(
                "%s: the stored history did not alternate user/model; dropped %d unpaired message(s) (ids %s)",
                self.dir / "history.sqlite3", len(stray), ", ".join(str(m.id) for m in stray[:10]))
            with self._lock:
                self.db.execute("BEGIN IMMEDIATE")
                self.db.executemany("DELETE FROM messages WHERE id = ?", [(m.id,) for m in stray])
                self.db.execute("COMMIT")
            for m in stray:
                if m.audio_path:
                    Path(m.audio_path).unlink(missing_ok=True)
        return kept

    def _write_audio(self, audio: Optional[np.ndarray]) -> Optional[str]:
        if audio is None or not self.keep_audio or not len(audio):
            return None
        from .audio.files import MODEL_RATE, write_wav

        p = self.dir / "audio" / f"{int(time.time())}-{uuid.uuid4().hex[:8]}.wav"
        write_wav(p, audio, MODEL_RATE)
        return str(p)

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
