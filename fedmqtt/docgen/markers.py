"""Generated parts inside hand-written files: the text between two marker lines is the generator's."""

from __future__ import annotations


def splice(text: str, generated: str, *, begin: str, end: str, path: str) -> str:
    """`text` (the content of `path`) with what lies between the marker lines `begin` and `end` replaced by
    `generated`; ValueError unless each marker is there once, `begin` first."""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{path} must hold the marker lines {begin!r} and {end!r} once each, in this order")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n\n{generated.strip()}\n\n{end}{tail}"
