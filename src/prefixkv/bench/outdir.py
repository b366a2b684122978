"""The output folder of a run, replaced as a whole: the report is written into a staging
folder beside it and renamed into place at the end, so a run that fails or is
interrupted leaves the previous report untouched, and a finished one never leaves an old
plot beside its new report.

::

    parent/.NAME.tmp-1a2b3c4d   staging, created before the run (proves we can write)
    parent/NAME                 the old report (or nothing) until publish():
                                NAME -> .NAME.old-...,  staging -> NAME,  remove the old
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from .errors import BenchError
from .report import FILES


class ReportDir:
    """Checks ``path`` and creates the staging folder; ``staging`` is where to write.

    ``path`` must be absent, or a folder (not a symbolic link) holding only files a report
    writes (``FILES``), so that replacing it deletes nothing else, and neither the working
    folder nor one above it (renamed away, it would leave the caller's shell in a deleted
    folder). Raises BenchError, before any work, when it is a file or a link, holds other
    files, is or holds the working folder, or the folder or its staging sibling cannot be
    created.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path).absolute()
        here = Path.cwd()
        if here == self.path.resolve() or self.path.resolve() in here.parents:
            shown = str(path) or "''"
            raise BenchError(f"--out {shown} is the working folder or holds it: replacing "
                             f"it would leave this shell in a deleted folder; give a folder "
                             f"inside it (the default: prefixkv-bench)")
        _check(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.staging = self.path.parent / f".{self.path.name}.tmp-{secrets.token_hex(4)}"
            self.staging.mkdir()
        except OSError as exc:
            raise BenchError(f"--out {path}: cannot create the output folder "
                             f"({exc.strerror or exc})") from None
        self._keep = False

    def publish(self) -> None:
        """Put the staging folder in place of ``path``. Raises BenchError (and keeps the
        staging folder, naming it) when ``path`` gained other files during the run;
        OSError when a rename fails (the old report is put back first)."""
        try:
            _check(self.path, during=True)
        except BenchError as exc:
            self._keep = True
            raise BenchError(f"{exc}; the new report is in {self.staging}") from None
        if not self.path.exists():
            os.rename(self.staging, self.path)
            return
        old = self.path.parent / f".{self.path.name}.old-{secrets.token_hex(4)}"
        os.rename(self.path, old)
        try:
            os.rename(self.staging, self.path)
        except OSError:
            os.rename(old, self.path)
            raise
        shutil.rmtree(old)

    def discard(self) -> None:
        """Remove the staging folder if it is still there (not published, not kept)."""
        if not self._keep:
            shutil.rmtree(self.staging, ignore_errors=True)


def _check(path: Path, during: bool = False) -> None:
    if path.is_symlink():
        raise BenchError(f"--out {path} is a symbolic link; give the folder it points to")
    if not path.exists():
        return
    if not path.is_dir():
        raise BenchError(f"--out {path} is a file, not a folder")
    others = sorted(p.name for p in path.iterdir() if p.name not in FILES or not p.is_file())
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        verb = "gained files during the run that are not" if during else "holds files that are not"
        raise BenchError(f"--out {path} {verb} a bench report ({shown}); give a new folder, an "
                         f"empty one or an earlier report's")
