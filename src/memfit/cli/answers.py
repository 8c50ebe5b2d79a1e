"""``memfit plan`` answers kept on disk: the same question asked again prints its answer without building the model.

Most of a repeated answer's time is not the trace (the trace cache keeps those) but building the model to key it:
importing transformers alone takes seconds. A question on the command line names everything the answer depends
on, so the whole answer can be kept, keyed by:

* the command line as typed (what a parse makes of it is a function of it and of what the key holds besides), the
  working folder, and the bytes of every file it names (``--hf-config``'s ``config.json``);
* the environment (every variable but a shell's and a login's own bookkeeping, such as ``SSH_CLIENT``), whether
  standard output is a terminal and its size (the tables are drawn for it), whether a CUDA device is visible, and
  this machine's physical RAM (which the sharded answer compares host RAM with);
* the versions of Python and of every installed distribution, and memfit's own source by content.

What is live stays live: the host RAM line's "available here" (and its verdict) is measured again when an answer
is replayed, in text and in ``--json``; warnings the answer raised are raised again (not those about a damaged
cache entry, which was the first run's to see). The console script (``memfit.cli.entry``) replays a kept answer
before it parses the command line, so it imports neither the planner nor torch. An answer is not kept when it comes
from user code (``--model``, ``--loss``), writes a file (``--plot``), plans for a GPU this machine would have to be
asked about (no ``--gpu`` or ``--budget``), ends with an error, or printed to standard error anything but warnings.

Entries are gzip'd JSON in ``answers/`` under the cache folder (``memfit cache``); the trace cache's switches turn
this one off and move it too. An entry that cannot be read, or was written for another key, is ignored with one
warning and deleted, and the question is answered afresh.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from memfit.cache_identity import CACHE_ENV, cache_root, enabled, installed_distributions, memfit_source_digest
from memfit.host_memory import machine_ram_bytes

__all__ = ["answer_dir", "answered", "clear", "host_line", "json_answer", "prepare_environment", "replay_kept"]

FORMAT = 1
# a shell's and a login's own bookkeeping, which differ from one terminal or login to the next and reach no answer
_SHELL_BOOKKEEPING = {
    "_", "SHLVL", "OLDPWD", "PWD", "PS1", "PS2", "HISTFILE", "LS_COLORS", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY",
    "SSH_AUTH_SOCK", "TMUX", "TMUX_PANE", "STY", "WINDOW", "WINDOWID", "TERM_SESSION_ID", "XDG_SESSION_ID",
    "XDG_RUNTIME_DIR", "SHELL_SESSION_ID", "KITTY_WINDOW_ID", "ITERM_SESSION_ID", "VSCODE_GIT_IPC_HANDLE",
    "GPG_TTY", "MAIL", "LOGNAME", "MOTD_SHOWN",
}  # fmt: skip
# warnings about the cache itself are about the run that read it, not part of the answer
_ABOUT_THE_CACHE = ("memfit ignored the trace cache entry",)
# set by torch (``KMP_*`` as it loads, the inductor's cache folder as a trace runs) in the process itself
_SET_BY_TORCH = {"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TORCHINDUCTOR_CACHE_DIR"}
_WARNINGS = {cls.__name__: cls for cls in (UserWarning, RuntimeWarning, FutureWarning, DeprecationWarning)}


def answer_dir() -> Path:
    return cache_root() / "answers"


def clear() -> int:
    """Delete every kept answer; how many there were."""
    folder = answer_dir()
    paths = list(folder.glob("*.json.gz")) if folder.is_dir() else []
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


# ------------------------------------------------------------------------------------------------------ the key


def prepare_environment() -> None:
    """The environment every ``memfit`` command runs in, set before its key is read (the key holds the environment).
    transformers' warnings about the configs are not the plan's."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def question_key(args: Any, argv: list[str]) -> str | None:
    """Everything the answer to ``memfit plan ARGV`` depends on, or ``None`` for a question not kept."""
    if not enabled() or args.command != "plan" or any(getattr(args, name, None) for name in _USER_CODE_OR_FILES):
        return None
    if not (getattr(args, "gpu", None) or getattr(args, "budget", None)) or not getattr(args, "hf_config", None):
        return None
    return _key(argv)


def replay_kept(argv: list[str]) -> int | None:
    """Print the kept answer of ``memfit ARGV`` and return its exit code; ``None`` where there is none.

    Read from the command line as typed, before it is parsed: parsing it imports the planner. The key needs no
    parse (what the parse makes of it is a function of the command line and of the code and environment the key
    holds), and an entry exists only for a question that was kept."""
    if not enabled() or not argv or argv[0] != "plan" or _HELP_OR_VERSION & set(argv):
        return None
    entry = _load(_key(argv))
    return None if entry is None else _replay(entry)


# options whose answer is not kept: user code (``--model``, ``--loss``) that no version names, a file written
_USER_CODE_OR_FILES = ("model", "loss", "plot")
_HELP_OR_VERSION = {"-h", "--help", "--version"}


def _key(argv: list[str]) -> str:
    terminal = sys.stdout.isatty()
    key = {
        "format": FORMAT,
        "argv": argv,
        "files": _files_named(argv),
        "cwd": os.getcwd(),
        "environment": sorted(
            (k, v) for k, v in os.environ.items() if k not in _SHELL_BOOKKEEPING and k not in _SET_BY_TORCH
        ),
        "terminal": [terminal, tuple(shutil.get_terminal_size()) if terminal else None],
        "cuda_visible": _cuda_visible(),
        "machine_ram": machine_ram_bytes(),
        "python": sys.version,
        "machine": platform.machine(),
        "packages": installed_distributions(),
        "memfit_source": memfit_source_digest(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _files_named(argv: list[str]) -> list[list[str]]:
    """The bytes (by hash) of every file the command line names (``--hf-config`` a ``config.json`` or its folder),
    however it is spelled (``--hf-config=PATH``, an abbreviated option)."""
    found = []
    for token in argv:
        for text in {token, token.partition("=")[2]} - {""}:
            path = Path(text).expanduser()
            path = path / "config.json" if path.is_dir() else path
            if path.is_file():
                found.append([text, hashlib.sha256(path.read_bytes()).hexdigest()])
    return found


def _cuda_visible() -> bool:
    """Whether torch sees a CUDA (or ROCm) device, without importing torch where it cannot: on Linux, with none of
    the device files a CUDA or ROCm driver makes (``/dev/nvidia*``, WSL's ``/dev/dxg``, ROCm's ``/dev/kfd``)."""
    if sys.platform.startswith("linux") and not any(any(Path("/dev").glob(pattern)) for pattern in _GPU_DEVICE_FILES):
        return False
    from memfit.devices import backend_for

    return backend_for("cuda").is_available()


_GPU_DEVICE_FILES = ("nvidia*", "dxg", "kfd")


# ------------------------------------------------------------------------------------------ record and replay


@dataclass
class _Recording:
    """What an answer printed: standard output's text, where the live host line sits in it, its warnings."""

    stdout: io.StringIO = field(default_factory=io.StringIO)
    host: list[dict[str, Any]] = field(default_factory=list)  # {"start", "end", "fields", "verdict", "width"}
    json: Any = None
    stderr_written: bool = False


_recording: _Recording | None = None


class _Tee(io.TextIOBase):
    """A text stream that writes through to ``target`` and lets ``seen`` look at what passes."""

    def __init__(self, target: TextIO, seen: Callable[[str], None]) -> None:
        self._target, self._seen = target, seen

    def write(self, text: str) -> int:
        self._seen(text)
        return self._target.write(text)

    def flush(self) -> None:
        self._target.flush()

    def isatty(self) -> bool:
        return self._target.isatty()

    def fileno(self) -> int:
        return self._target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", "utf-8")


def host_line(console: Any, host: Any, verdict: str) -> None:
    """Print the host RAM line (``host.summary() + verdict``), marked as live in an answer being kept."""
    recording = _recording
    start = recording.stdout.tell() if recording else 0
    console.print(host.summary() + verdict, highlight=False)
    if recording:
        fields = {name: getattr(host, name) for name in host.__dataclass_fields__}
        recording.host.append({"start": start, "end": recording.stdout.tell(), "fields": fields,
                               "width": console.width})  # fmt: skip


def json_answer(answer: dict[str, Any]) -> None:
    """Print a ``--json`` answer, kept as data so that its host RAM figures are measured again on replay."""
    if _recording:
        _recording.json = answer
    print(json.dumps(answer, indent=2))


def answered(args: Any, argv: list[str], run: Callable[[], int]) -> int:
    """``run()``'s exit code, its answer printed from the cache where this question was answered before."""
    key = question_key(args, argv)
    if key is None:
        return run()
    entry = _load(key)
    if entry is not None:
        return _replay(entry)
    global _recording
    recording = _recording = _Recording()

    def on_stderr(text: str) -> None:
        recording.stderr_written = recording.stderr_written or bool(text)

    stdout, stderr = sys.stdout, sys.stderr
    with warnings.catch_warnings(record=True) as caught:
        sys.stdout, sys.stderr = _Tee(stdout, recording.stdout.write), _Tee(stderr, on_stderr)
        try:
            code = run()
        finally:
            sys.stdout, sys.stderr, _recording = stdout, stderr, None
    shown = [[str(w.message), type(w.message).__name__, w.filename, w.lineno] for w in caught]
    _show(shown)
    shown = [warning for warning in shown if not warning[0].startswith(_ABOUT_THE_CACHE)]
    terminal_stderr = stderr.isatty()  # there the spinner draws on standard error; elsewhere nothing else may
    if code in (0, 1) and (terminal_stderr or not recording.stderr_written):
        _store(key, {"code": code, "stdout": recording.stdout.getvalue(), "host": recording.host,
                     "json": recording.json, "warnings": shown})  # fmt: skip
    return code


def _show(shown: list[list[Any]]) -> None:
    for message, category, filename, lineno in shown:
        warnings.showwarning(message, _WARNINGS.get(category, UserWarning), filename, lineno)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Replay:
    """A kept answer, rendered for this machine (its host RAM lines live): what it prints, warns and exits with."""

    code: int
    text: str
    warnings: tuple[tuple[str, str, str, int], ...]


def _rendered(answer: dict[str, Any]) -> _Replay:
    """The kept answer rendered before anything is printed: a damaged entry fails here, where it is ignored."""
    from memfit.prediction.host import available_ram_bytes

    shown = tuple((str(m), str(c), str(f), int(n)) for m, c, f, n in answer["warnings"])
    if answer["json"] is not None:
        data = answer["json"]
        for host in _hosts(data):
            if host.get("available_bytes") is not None:
                host["available_bytes"] = available_ram_bytes()
                host["fits"] = host["total_bytes"] <= host["available_bytes"]
        return _Replay(answer["code"], json.dumps(data, indent=2) + "\n", shown)
    text, done, parts = answer["stdout"], 0, []
    for mark in answer["host"]:
        parts += [text[done : mark["start"]], _live_host_line(mark, available_ram_bytes())]
        done = mark["end"]
    return _Replay(answer["code"], "".join([*parts, text[done:]]), shown)


def _replay(replay: _Replay) -> int:
    _show([list(warning) for warning in replay.warnings])
    sys.stdout.write(replay.text)
    return replay.code


def _live_host_line(mark: dict[str, Any], available: int | None) -> str:
    from memfit.cli.console import stdout_console
    from memfit.prediction.host import HostEstimate

    fields = dict(mark["fields"])
    if fields.get("available_bytes") is not None:
        fields["available_bytes"] = available
    host = HostEstimate(**fields)
    verdict = "; more than this machine has available" if host.fits is False else ""
    console = stdout_console(width=mark["width"], file=io.StringIO(), force_terminal=sys.stdout.isatty())
    with console.capture() as captured:
        console.print(host.summary() + verdict, highlight=False)
    return captured.get()


def _hosts(answer: Any) -> Iterator[dict[str, Any]]:
    """Every host RAM estimate in a ``--json`` answer."""
    if isinstance(answer, dict):
        if isinstance(answer.get("host"), dict):
            yield answer["host"]
        for value in answer.values():
            if isinstance(value, (dict, list)):
                yield from _hosts(value)
    elif isinstance(answer, list):
        for value in answer:
            yield from _hosts(value)


# ---------------------------------------------------------------------------------------------------- on disk


def _path(key: str) -> Path:
    return answer_dir() / f"{key}.json.gz"


_IGNORED: set[Path] = set()  # entries this process said it ignored


def _load(key: str) -> _Replay | None:
    path = _path(key)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as file:
            entry = json.load(file)
        if entry.get("format") != FORMAT or entry.get("key") != key:
            raise ValueError("it was written for another question")
        answer = entry["answer"]
        if not isinstance(answer["code"], int) or not isinstance(answer["stdout"], str):
            raise ValueError("it is not an answer")
        return _rendered(answer)
    except FileNotFoundError:
        return None
    except Exception as exc:  # a damaged or foreign entry: answered afresh
        if path in _IGNORED:  # said once (asked again after the parse, or a folder that cannot be removed)
            return None
        _IGNORED.add(path)
        print(
            f"memfit: warning: ignored the kept answer {path} ({type(exc).__name__}: {str(exc)[:120]}) and answers "
            f"afresh; delete {path.parent} or set {CACHE_ENV}=off if this repeats",
            file=sys.stderr,
        )
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return None


def _store(key: str, answer: dict[str, Any]) -> None:
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".part")
        with os.fdopen(handle, "wb") as raw, gzip.open(raw, "wt", encoding="utf-8", compresslevel=3) as file:
            json.dump({"format": FORMAT, "key": key, "answer": answer}, file, separators=(",", ":"))
        os.replace(temporary, path)
    except OSError:
        return
