"""The one rule for the files hpdl's commands write where the user names them.

A command refuses, before any work and again right before the write replaces the file:

- a path that can never be its file: a directory, or one under a file where a directory must
  be (``x/out.json`` with ``x`` a file), or, for a command that makes no directories, one whose
  directory does not exist;
- one of its own inputs, however the path spells it (a link, a hard link, a ``..`` after a
  directory still to be made): the output would destroy what it was made from;
- without ``overwrite`` (``--overwrite``), any other existing file.

Every message names the output as the user gave it (after the option it came from) and says
why, in one line. The write itself is atomic (:func:`hpdl.atomic_file.atomic_write`): readers
see the old file or the whole new one, and a failure leaves neither a partial file nor a temp
file.
"""

from __future__ import annotations

import io
import os
from typing import IO, Callable, Dict, Iterable, Optional, Tuple, Union

from hpdl.atomic_file import atomic_write, blocking_file, not_a_directory

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["OutputError", "OutputRule", "same_file", "write_file"]


class OutputError(ValueError):
    """A file a command cannot or must not write; the message names it and says why (one line)."""


class OutputRule:
    """Where a command's outputs may be written: never over one of its inputs, and over an
    existing file only with ``overwrite``.

    The command calls :meth:`refuse` before any work; :meth:`write` (or the ``check_target``
    of :meth:`check_before_rename`) checks the file the rename will replace again, once the
    directories exist and right before the rename.
    """

    def __init__(self, inputs: Iterable[Tuple[str, PathLike]] = (), overwrite: bool = False,
                 make_directories: bool = True) -> None:
        """
        Args:
            inputs: ``(what, path)`` of every file the command reads, e.g. ``("checkpoint", "c.pt")``.
            overwrite: whether an existing file (never an input) may be replaced.
            make_directories: whether the write makes missing directories (else they must exist).
        """
        self.overwrite = overwrite
        self.make_directories = make_directories
        self._inputs: Dict[Tuple[int, int], Tuple[str, str]] = {}  # (device, inode) -> (what, path)
        for what, path in inputs:
            try:
                st = os.stat(path)
            except OSError:  # a missing input is reported when it is read
                continue
            self._inputs.setdefault((st.st_dev, st.st_ino), (what, str(path)))

    def refuse(self, output: PathLike, option: Optional[str] = None) -> None:
        """Refuse ``output`` before any work, as written and as its write will resolve it.

        Raises:
            OutputError: naming ``option`` (where the path came from, e.g. ``--json``) and ``output``.
        """
        output = str(output)
        if not output:
            raise OutputError(f"{option}: empty path; give a file name" if option else
                              "empty output path: give a file name")
        where = _where(output, option)
        if os.path.isdir(output) or os.path.isdir(os.path.realpath(output)):
            raise OutputError(f"{where}: is a directory; name a file")
        directory = os.path.dirname(os.path.abspath(output))
        blocker = blocking_file(directory)
        if blocker is not None:
            raise OutputError(f"{where}: {not_a_directory(blocker)}")
        if not self.make_directories and not os.path.isdir(directory):
            raise OutputError(f"{where}: its directory does not exist")
        self._check(where, output)
        # Non-strict realpath collapses "missing/.." as making "missing" will make it mean.
        self._check(where, os.path.realpath(output))

    def refuse_directory(self, directory: PathLike, option: Optional[str] = None) -> None:
        """Refuse, before any work, an output directory that can never be made: a file is in the way."""
        blocker = blocking_file(directory)
        if blocker is not None:
            raise OutputError(f"{_where(str(directory), option)}: {not_a_directory(blocker)}")

    def check_before_rename(self, output: PathLike, option: Optional[str] = None) -> Callable[[str], None]:
        """The ``check_target`` for :func:`hpdl.atomic_file.atomic_write` writing ``output``:
        it refuses the file the rename would replace, naming ``output``."""
        where = _where(str(output), option)
        return lambda target: self._check(where, target)

    def write(self, output: PathLike, write: Callable[[IO], None], binary: bool = False,
              option: Optional[str] = None) -> None:
        """Write ``output`` atomically under this rule (``binary=False``: ``write`` gets a UTF-8 text stream).

        Raises:
            OutputError: the rule refuses the file now, or the file system refuses the write
                (naming ``output`` and the reason).
        """
        try:
            write_file(output, write, binary, check_target=self.check_before_rename(output, option))
        except OSError as err:
            if err.errno is None:
                raise
            raise OutputError(f"cannot write {output}: {err.strerror or err}") from None

    def _check(self, where: str, target: str) -> None:
        """Refuse writing the file ``target`` (``where`` is how the user named it)."""
        try:
            st = os.stat(target)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) in self._inputs:
            what, path = self._inputs[(st.st_dev, st.st_ino)]
            raise OutputError(f"{where}: is the {what} {path}; write to another file")
        if not self.overwrite and os.path.lexists(target):
            raise OutputError(f"{where}: already exists; pass --overwrite to replace it")


def _where(output: str, option: Optional[str]) -> str:
    return f"{option} {output}" if option else output


def write_file(path: PathLike, write: Callable[[IO], None], binary: bool = False,
               check_target: Optional[Callable[[str], None]] = None) -> None:
    """Call ``write(f)`` on a temp file beside ``path``, then rename it over ``path``
    (:func:`hpdl.atomic_file.atomic_write`; ``binary=False`` gives ``write`` a UTF-8 text stream).

    Raises:
        OSError: naming ``path`` when the file system refuses it.
    """
    def write_stream(f) -> None:
        if binary:
            write(f)
            return
        text = io.TextIOWrapper(f, encoding="utf-8")
        write(text)
        text.detach().flush()  # leave the binary stream open: atomic_write closes it

    atomic_write(path, write_stream, check_target=check_target)


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether the paths ``a`` and ``b`` name one file (never true while one does not exist,
    unless they are spelt alike)."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist yet: different paths, different files
        return False
