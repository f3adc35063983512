"""What every benchmark shares: arguments, timing, the machine, and writing JSON + Markdown + PNG."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import matplotlib

from envsync.envs import start_method  # noqa: F401 (the benchmarks build collectors under it)

matplotlib.use("Agg")

RESULTS = Path(__file__).resolve().parent / "results"

A = TypeVar("A")


def parse_args(argv: Sequence[str] | None, cls: type[A], doc: str | None, quick: Callable[[A], A]) -> A:
    """Build a command line from the dataclass ``cls`` (one ``--flag`` per field, lists take
    several values), plus ``--quick`` (``quick`` shrinks the budget) and ``--out``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny budget (a smoke run, well under a minute)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results[/quick])")
    defaults = cls()
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in ("quick", "out"):
            continue
        value = getattr(defaults, field.name)
        flag = f"--{field.name.replace('_', '-')}"
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true", default=None)
        elif isinstance(value, list):
            parser.add_argument(flag, nargs="+", type=type(value[0]), default=None)
        else:
            parser.add_argument(flag, type=type(value), default=None)
    ns = parser.parse_args(argv)
    args = quick(defaults) if ns.quick else defaults
    given = {k: v for k, v in vars(ns).items() if v is not None and k not in ("quick", "out")}
    out = ns.out or (RESULTS / "quick" if ns.quick else RESULTS)
    return dataclasses.replace(args, quick=ns.quick, out=out, **given)  # type: ignore[type-var]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def envsync_fingerprint() -> str:
    """A short hash of envsync's source files: which code the numbers were measured on."""
    import envsync

    digest = hashlib.sha1()
    for path in sorted(Path(envsync.__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


SOURCE_AT_START = envsync_fingerprint()


def _commit() -> str:
    """The checkout's commit (``+changes`` when envsync's tracked files differ from it)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "envsync"], cwd=root, capture_output=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.returncode else "")


def machine() -> dict[str, Any]:
    """The facts a reader needs to weigh the numbers."""
    import gymnasium
    import tensordict
    import torch
    import torchrl

    return {
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "envsync_source_sha1": envsync_fingerprint(),
        "envsync_source_sha1_at_start": SOURCE_AT_START,
        "cpus": os.cpu_count(),
        "load_avg_1min": os.getloadavg()[0],
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
        "tensordict": tensordict.__version__,
        "gymnasium": gymnasium.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def target(name: str, measured: float, goal: float, *, higher_is_better: bool, unit: str = "x") -> dict[str, Any]:
    """One target of the issue, checked against a ratio measured in this run."""
    met = measured >= goal if higher_is_better else measured <= goal
    return {
        "target": name,
        "measured": measured,
        "goal": f"{'>=' if higher_is_better else '<='} {goal:g}{unit}",
        "met": bool(met),
    }


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "-"
    return "-" if value is None else str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """``columns`` are (key, header) pairs."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(k)) for k, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def targets_table(targets: Sequence[dict[str, Any]]) -> str:
    return markdown_table(targets, [("target", "target"), ("measured", "measured"), ("goal", "goal"), ("met", "met")])


@dataclasses.dataclass
class Report:
    """What a benchmark hands back: written as ``<name>.json`` and ``<name>.md``.

    ``tables`` are (title, columns) views of ``rows``; columns are (key, header) pairs.
    """

    name: str
    args: Any
    rows: list[dict[str, Any]]
    tables: list[tuple[str, list[tuple[str, str]]]]
    summary: dict[str, Any]
    targets: list[dict[str, Any]]
    notes: list[str] = dataclasses.field(default_factory=list)

    def markdown(self) -> str:
        parts = [f"### {self.name}"]
        for title, columns in self.tables:
            parts += ["", f"{title}:", "", markdown_table(self.rows, columns)]
        if self.targets:
            parts += ["", "Targets:", "", targets_table(self.targets)]
        if self.notes:
            parts += [""] + [f"- {note}" for note in self.notes]
        return "\n".join(parts) + "\n"

    def write(self, out: Path) -> dict[str, Any]:
        """Write JSON and Markdown under ``out``; print the tables; return the JSON document."""
        out.mkdir(parents=True, exist_ok=True)
        args = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self.args).items()}
        facts = machine()
        if facts["envsync_source_sha1"] != facts["envsync_source_sha1_at_start"]:
            self.notes.append("WARNING: envsync's source changed while this ran; the numbers mix two versions")
        document = {
            "benchmark": self.name,
            "quick": bool(args.get("quick")),
            "args": args,
            "machine": facts,
            "rows": self.rows,
            "summary": self.summary,
            "targets": self.targets,
            "notes": self.notes,
        }
        (out / f"{self.name}.json").write_text(json.dumps(document, indent=2) + "\n")
        text = self.markdown()
        (out / f"{self.name}.md").write_text(text)
        print("\n" + text)
        return document


def save_plot(fig: Any, out: Path, name: str) -> Path:
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def paired_bars(
    ticks: Sequence[str], left: tuple[str, Sequence[float]], right: tuple[str, Sequence[float]], ylabel: str, title: str
) -> tuple[Any, Any]:
    """A figure of two bars per tick (``(label, values)`` each side): the instruction
    benchmarks' plots. Returns ``(fig, ax)`` for any annotation; save it with :func:`save_plot`."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 2.6 * len(ticks)), 3.6))
    x = range(len(ticks))
    for shift, (label, values) in ((-0.2, left), (0.2, right)):
        ax.bar([i + shift for i in x], list(values), width=0.4, label=label)
    ax.set_xticks(list(x), list(ticks))
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    return fig, ax


def require_callgrind() -> None:
    """Exit with how to install valgrind when it (or ``callgrind_control``) is missing."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (with callgrind_control) is not installed: apt-get install valgrind")


def callgrind_control(*args: str, timeout: float = 300) -> None:
    """``callgrind_control`` with ``args`` (``-i on|off PID`` switches counting, ``-d PID`` dumps)."""
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=timeout)


def callgrind_total(path: Path) -> int:
    """The instructions a callgrind output file counts (its ``totals:`` line; 0 if none)."""
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    return 0


class CountedChild:
    """A benchmark's child process (``script --child *args``), under valgrind's callgrind
    with counting off at start when ``count`` (``trace_children``: its own children too, each
    its own valgrind). The child prints ``ready <pids>``, waits for a line, runs the counted
    part, prints ``done <fields>``, waits for a line and exits: :meth:`counted` switches
    counting on for those pids around the counted part and dumps their counts.
    ``env``: extra environment variables; the benchmarks' folder goes on ``PYTHONPATH``."""

    def __init__(
        self,
        script: str,
        args: Sequence[str],
        *,
        count: bool,
        trace_children: bool = True,
        env: dict[str, str] | None = None,
        what: str = "child",
    ) -> None:
        self.what = what
        self.folder = Path(tempfile.mkdtemp(prefix="envsync-callgrind-")) if count else None
        command = [sys.executable, script, "--child", *args]
        if self.folder is not None:
            command = [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--trace-children={'yes' if trace_children else 'no'}",
                f"--callgrind-out-file={self.folder}/cg.%p",
                *command,
            ]
        here = str(Path(script).resolve().parent)
        environment = {
            **os.environ,
            **(env or {}),
            "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
        }
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=environment,
        )

    def line(self, word: str) -> list[str]:
        """The fields of the child's next line, which must start with ``word``."""
        assert self.process.stdout is not None
        got = self.process.stdout.readline().split()
        if not got or got[0] != word:
            raise RuntimeError(f"the {self.what} did not say {word!r}")
        return got[1:]

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def counted(self, timeout: float = 600) -> tuple[list[str], list[str], float]:
        """Run the counted part (counting on for the pids the child names, when counting);
        return those pids, the ``done`` fields and the part's wall seconds; the child exits."""
        pids = self.line("ready")
        if self.folder is not None:
            for pid in pids:
                callgrind_control("-i", "on", pid)
        start = time.perf_counter()
        self.go()
        done = self.line("done")
        seconds = time.perf_counter() - start
        if self.folder is not None:
            for pid in pids:
                callgrind_control("-i", "off", pid)
                callgrind_control("-d", pid)  # dump now: a worker may be stopped before it exits
        self.go()
        self.process.wait(timeout=timeout)
        return pids, done, seconds

    def instructions(self, pid: str | None = None) -> int:
        """The instructions counted in process ``pid`` (its dump ``cg.<pid>.1`` and what it
        wrote at exit, ``cg.<pid>``), or in every process (``None``); 0 when not counting."""
        if self.folder is None:
            return 0
        paths = [p for p in self.folder.iterdir() if pid is None or p.name.split(".")[1] == pid]
        return sum(callgrind_total(path) for path in paths)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
