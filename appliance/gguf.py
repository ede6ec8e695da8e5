"""GGUF headers read with ggml's own parser, and the KV cache a model needs.

:func:`read_gguf` calls ``gguf_init_from_file`` (``no_alloc``: no tensor data is read) in the
``libggml-base`` that llama-cpp-python ships, through ctypes, so the doctor and the config check can
look at a multi-gigabyte model in milliseconds without loading it. :func:`kv_cache_bytes` turns the
header's attention shapes into the KV cache's size in bytes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError

KV_BYTES_PER_ELEMENT = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}  # bytes per K or V element (q8_0, q4_0: 32-element blocks)


class _Params(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_GGML = None
# gguf_type (ggml/include/gguf.h)
_GT_U8, _GT_I8, _GT_U16, _GT_I16, _GT_U32, _GT_I32, _GT_F32, _GT_BOOL, _GT_STR, _GT_ARR, _GT_U64, _GT_I64, _GT_F64 = range(13)
_ARR_CTYPE = {_GT_U8: ctypes.c_uint8, _GT_I8: ctypes.c_int8, _GT_U16: ctypes.c_uint16, _GT_I16: ctypes.c_int16,
              _GT_U32: ctypes.c_uint32, _GT_I32: ctypes.c_int32, _GT_F32: ctypes.c_float, _GT_BOOL: ctypes.c_bool,
              _GT_U64: ctypes.c_uint64, _GT_I64: ctypes.c_int64, _GT_F64: ctypes.c_double}


def _ggml():
    """``libggml-base`` from the installed llama-cpp-python, with the gguf_* signatures declared."""
    global _GGML
    if _GGML is not None:
        return _GGML
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("llama-cpp-python is not installed: run `make venv`")
    libdir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    names = sorted(libdir.glob("libggml-base.*"))
    if not names:
        raise UserError(f"{libdir}: libggml-base not found; reinstall llama-cpp-python")
    lib = ctypes.CDLL(str(names[0]))
    c_p, i64, size = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
    sigs = {
        "gguf_init_from_file": (c_p, [ctypes.c_char_p, _Params]), "gguf_free": (None, [c_p]),
        "gguf_get_version": (ctypes.c_uint32, [c_p]), "gguf_get_data_offset": (size, [c_p]),
        "gguf_find_key": (i64, [c_p, ctypes.c_char_p]), "gguf_get_kv_type": (ctypes.c_int, [c_p, i64]),
        "gguf_get_arr_type": (ctypes.c_int, [c_p, i64]), "gguf_get_arr_n": (size, [c_p, i64]),
        "gguf_get_arr_data": (c_p, [c_p, i64]), "gguf_get_val_str": (ctypes.c_char_p, [c_p, i64]),
        "gguf_get_val_data": (c_p, [c_p, i64]), "gguf_get_n_tensors": (i64, [c_p]),
        "gguf_get_tensor_offset": (size, [c_p, i64]), "gguf_get_tensor_size": (size, [c_p, i64]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    _GGML = lib
    return lib


@dataclass
class GgufInfo:
    """What doctor needs from a GGUF header. ``needed_bytes``: where the last tensor's data ends."""

    path: Path
    file_bytes: int
    needed_bytes: int
    version: int
    n_tensors: int
    meta: dict = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.file_bytes < self.needed_bytes


def _value(lib, ctx, key_id: int) -> Any:
    kind = lib.gguf_get_kv_type(ctx, key_id)
    if kind == _GT_STR:
        return lib.gguf_get_val_str(ctx, key_id).decode("utf-8", "replace")
    if kind == _GT_ARR:
        elem = lib.gguf_get_arr_type(ctx, key_id)
        if elem not in _ARR_CTYPE:
            return None  # arrays of strings (the vocabulary) are not needed
        n = lib.gguf_get_arr_n(ctx, key_id)
        ptr = ctypes.cast(lib.gguf_get_arr_data(ctx, key_id), ctypes.POINTER(_ARR_CTYPE[elem]))
        return [ptr[i] for i in range(n)]
    if kind in _ARR_CTYPE:
        return ctypes.cast(lib.gguf_get_val_data(ctx, key_id), ctypes.POINTER(_ARR_CTYPE[kind]))[0]
    return None


def read_gguf(path: str | Path, keys: tuple[str, ...] = ()) -> GgufInfo:
    """Parse a GGUF header (no tensor data is read) with ggml's ``gguf_init_from_file``.

    :param keys: metadata keys to return in ``meta``; ``{arch}`` is replaced by ``general.architecture``.
    :raises ValueError: not a GGUF (the message is ggml's reason, e.g. "invalid magic characters").
    :raises OSError: unreadable.
    """
    path = Path(path)
    with open(path, "rb") as fh:  # raises OSError for a missing or unreadable file
        fh.read(4)
    lib = _ggml()
    # ggml reports parse errors on stderr (fd 2): catch them as the reason instead of printing them.
    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        try:
            os.dup2(err.fileno(), 2)
            ctx = lib.gguf_init_from_file(str(path).encode(), _Params(True, None))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        reason = err.read().decode("utf-8", "replace").strip()
    if not ctx:
        last = reason.splitlines()[-1] if reason else "ggml could not parse it"
        raise ValueError(last.split(": ", 1)[-1])
    try:
        n = lib.gguf_get_n_tensors(ctx)
        end = max((lib.gguf_get_tensor_offset(ctx, i) + lib.gguf_get_tensor_size(ctx, i) for i in range(n)), default=0)
        meta: dict = {}
        arch_id = lib.gguf_find_key(ctx, b"general.architecture")
        arch = _value(lib, ctx, arch_id) if arch_id >= 0 else ""
        meta["general.architecture"] = arch
        for key in keys:
            k = key.replace("{arch}", arch)
            kid = lib.gguf_find_key(ctx, k.encode())
            if kid >= 0:
                meta[key] = _value(lib, ctx, kid)
        return GgufInfo(path, path.stat().st_size, lib.gguf_get_data_offset(ctx) + end,
                        lib.gguf_get_version(ctx), n, meta)
    finally:
        lib.gguf_free(ctx)


KV_KEYS = ("{arch}.block_count", "{arch}.embedding_length", "{arch}.attention.head_count",
            "{arch}.attention.head_count_kv", "{arch}.attention.key_length", "{arch}.attention.value_length",
            "{arch}.attention.shared_kv_layers", "{arch}.context_length", "clip.has_audio_encoder")


def kv_cache_bytes(meta: dict, n_ctx: int, kv_type: str) -> int:
    """Upper bound of the KV cache in bytes for ``n_ctx`` tokens.

    Per layer that has its own cache (the last ``shared_kv_layers`` reuse earlier ones), K and V hold
    ``head_count_kv × key_length`` and ``× value_length`` elements per token. Every layer counts ``n_ctx``
    tokens at the full-attention lengths: llama-cpp-python 0.3.36 allocates full-size sliding-window
    caches (its log: "using full-size SWA cache"), and the shorter ``*_swa`` lengths are not always used
    for V. Measured here against llama.cpp's log: Gemma 3 270M at n_ctx 2048 q4_0, estimate 10.1 MiB,
    llama.cpp 10.1 MiB (1.69 + 8.44); the tiny Gemma 4 fixture at 4096 f16, estimate 2.0, llama.cpp 1.75.
    """
    def per_layer(v, i):
        return v[i] if isinstance(v, list) else v

    n_layer = int(meta.get("{arch}.block_count") or 0)
    if not n_layer:
        return 0
    n_embd = int(meta.get("{arch}.embedding_length") or 0)
    heads = meta.get("{arch}.attention.head_count") or 1
    heads_kv = meta.get("{arch}.attention.head_count_kv") or heads
    shared = int(meta.get("{arch}.attention.shared_kv_layers") or 0)
    per = KV_BYTES_PER_ELEMENT[kv_type]
    total = 0.0
    for i in range(max(0, n_layer - shared)):
        head_dim = n_embd // max(1, int(per_layer(heads, i)))
        k = meta.get("{arch}.attention.key_length") or head_dim
        v = meta.get("{arch}.attention.value_length") or head_dim
        total += n_ctx * int(per_layer(heads_kv, i)) * (int(k) + int(v)) * per
    return int(total)
