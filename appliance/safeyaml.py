"""Reading the YAML files a user hands us (``config.yaml``, replay scenarios) so that no file can take the
process down: bounded size, bounded nesting, no anchors or aliases, duplicate keys found, one-line errors.

Anchors and aliases (``&name`` / ``*name``, and the ``<<`` merge key that needs them) are **refused
outright**, not capped: neither file format needs them, and an alias bomb ("billion laughs") of under
1 kB expands to gigabytes in every consumer that walks the data (line-number lookups, "did you mean",
``repr`` in an error). Nesting deeper than :data:`MAX_DEPTH` and files larger than :data:`MAX_BYTES` are
refused before anything is built from them, so PyYAML's recursive composer never runs out of stack.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any, Optional

import yaml
from yaml.composer import ComposerError

from .errors import UserError, yaml_problem

MAX_BYTES = 256 * 1024  # the commented default config.yaml is about 10 kB
MAX_DEPTH = 32  # mappings and lists inside each other; the config needs 3, a scenario 3


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing anchors, aliases and nesting deeper than :data:`MAX_DEPTH` while it
    composes the node tree (before any Python object is constructed)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ComposerError(None, None, "anchors and aliases (&name, *name, <<) are not allowed; write the "
                                "values out in full", event.start_mark)
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if self._depth >= MAX_DEPTH:
                raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
            self._depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)


def read_text(path: Path, what: str, fix_missing: str) -> str:
    """The text of a small UTF-8 file the user named, refusing what is not one.

    :param what: what the file is, for the messages ("config file", "scenario").
    :param fix_missing: the fix to print when the file does not exist.
    :raises UserError: missing, a directory, a FIFO/device/socket (never opened: a FIFO would block),
        larger than :data:`MAX_BYTES`, unreadable, or not UTF-8; one line naming the file and the fix.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found; {fix_missing}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the {what} ({exc.strerror}); check the path and its permissions") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{path}: is a directory; give the {what} itself")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path}: is not a regular file (a FIFO, socket or device); save the {what} to a file and give that")
    if st.st_size > MAX_BYTES:
        raise UserError(f"{path}: {st.st_size:,} bytes is too large for a {what} (at most {MAX_BYTES:,}); "
                        "give the right file, or trim it")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{path}: cannot read the {what} ({exc.strerror or exc.__class__.__name__}); check the "
                        "path and its permissions") from None
    if len(raw) > MAX_BYTES:
        raise UserError(f"{path}: too large for a {what} (more than {MAX_BYTES:,} bytes); give the right file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start}, line {line}); save it as UTF-8, e.g. "
                        f"`iconv -f latin1 -t utf-8 {path.name} > fixed.yaml`") from None


def compose(text: str) -> tuple[Optional[yaml.Node], Any]:
    """Parse YAML text into its node tree (for line numbers) and its Python data, safely.

    :returns: ``(node, data)``; ``(None, None)`` for an empty document.
    :raises yaml.YAMLError: invalid YAML, an anchor or alias, nesting deeper than :data:`MAX_DEPTH`
        (use :func:`yaml_problem` for the one-line text).
    """
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    return node, data


def duplicate_keys(node: Optional[yaml.Node], prefix: tuple = ()) -> list[tuple[int, str, int]]:
    """Keys given twice in one mapping (PyYAML silently keeps the last one).

    :returns: ``[(line, dotted.path, first_line), ...]`` with 1-based lines, in document order.
    """
    out: list[tuple[int, str, int]] = []
    stack = [(node, prefix)]
    while stack:
        n, pre = stack.pop()
        if isinstance(n, yaml.MappingNode):
            first: dict[str, int] = {}
            for key_node, value_node in n.value:
                key = str(key_node.value)
                line = key_node.start_mark.line + 1
                if key in first:
                    out.append((line, ".".join(pre + (key,)), first[key]))
                else:
                    first[key] = line
                stack.append((value_node, pre + (key,)))
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value, 1):
                stack.append((item, pre + (str(i),)))
    return sorted(out)


def load_file(path: Path, what: str, fix_missing: str, fix_syntax: str) -> tuple[Optional[yaml.Node], Any]:
    """:func:`read_text` then :func:`compose`, every failure as one :class:`UserError` line.

    :param fix_syntax: what to say after a YAML syntax error (e.g. "see the scenario format in docs/replay.md").
    :raises UserError: naming the file, the line when known, and the fix.
    """
    text = read_text(path, what, fix_missing)
    try:
        return compose(text)
    except yaml.YAMLError as exc:
        line, problem = yaml_problem(exc)
        where = f" at line {line}" if line else ""
        raise UserError(f"{path}: invalid YAML{where}: {problem}; {fix_syntax}") from None
    except (RecursionError, MemoryError, ValueError, TypeError) as exc:  # belt and braces: never a traceback
        raise UserError(f"{path}: cannot parse the {what} ({exc.__class__.__name__}: {str(exc)[:120]}); {fix_syntax}") from None
