"""The trainer's verdicts outlive its process: <run_dir>/verdict.json.

Exits 2 (bad input), 3 (diverged) and 4 (replicas disagree) are verdicts: running the same launch again
replays the same batches into the same end. torchrun restarts every non-zero exit and then itself exits 1,
so without a record on disk (1) a restarted worker cannot know that a restart cannot help, and (2) a
launcher (the Prefect train task) cannot learn which verdict ended the run.

A launch is one torchrun invocation: its workers share TORCHELASTIC_RUN_ID across its restarts. Its attempt
counts them from 0: TORCHELASTIC_RESTART_COUNT on one host; across hosts that count is each host's own (torch
counts a restart on the host whose worker failed only), so once the process group forms the ranks agree on
the sum of their hosts' counts (`agree_attempt`), which grows with every restart of any host. A record is
of *this* launch when it has the same non-empty run id and an earlier attempt. Ordering by attempt, not
the id alone, matters because a run id can be fixed by hand (`--rdzv-id=gpt2` in
docker/torchrun-multinode.sh, every night): a new launch starts at attempt 0, so last night's record is never
mistaken for tonight's. Any other record is moved aside at the next start
(kept as verdict.<time>.json, for whoever looks back at what ended that night).

    record(run_dir, 3, "the run diverged again ...")    # in the trainer's fail path, every rank may
    earlier = of_this_launch(run_dir)                   # at start: a Verdict -> exit with its code
    set_aside_stale(run_dir)                            # once the start is accepted
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gptcore.files import read_json, write_json
from gptcore.runlock import LAUNCHER_ENV

VERDICT_FILE = "verdict.json"
NAMES = {2: "bad input", 3: "diverged", 4: "replicas disagree"}  # the exit codes that are verdicts


@dataclass(frozen=True)
class Verdict:
    code: int
    verdict: str  # NAMES[code]
    text: str  # the error line's message
    launch: str | None  # TORCHELASTIC_RUN_ID, None outside torchrun
    attempt: int  # TORCHELASTIC_RESTART_COUNT
    time: str
    launched_by: object = None  # GPTPIPE_LAUNCHED_BY (e.g. the Prefect flow run), so a launcher knows its own

    def summary(self) -> str:
        """`diverged (exit 3): <text>`: how a launcher names the verdict (the Prefect task's error starts so)."""
        return f"{self.verdict} (exit {self.code}): {self.text}"


def launcher(env=None):
    """Who launched this trainer (GPTPIPE_LAUNCHED_BY, parsed as the run lock parses it), or None."""
    raw = (os.environ if env is None else env).get(LAUNCHER_ENV)
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw


_agreed: list[int] = []  # the attempt the ranks agreed on (agree_attempt), for this process's run


def host_restarts() -> int:
    """torchrun's restart count on this host."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def agree_attempt(attempt: int | None) -> None:
    """The attempt every rank of this launch agreed on (None: forget it, at the end of a run in-process)."""
    _agreed[:] = [] if attempt is None else [attempt]


def this_launch() -> tuple[str | None, int]:
    """(torchrun's run id or None, the attempt): the agreed attempt once there is one, else this host's count
    (the same thing on one host)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None, _agreed[0] if _agreed else host_restarts()


def record(run_dir: Path, code: int, text: str) -> None:
    """Write the verdict atomically (every rank may: the same verdict, the last writer wins). Only into a run
    directory that exists (a run that never started gets no directory for it), and a record that cannot be
    written is skipped: the exit code still says it, and a restart then only costs a start-up."""
    if not Path(run_dir).is_dir():
        return
    launch, attempt = this_launch()
    v = Verdict(code, NAMES[code], text, launch, attempt, time.strftime("%Y-%m-%dT%H:%M:%S%z"), launcher())
    try:
        write_json(Path(run_dir) / VERDICT_FILE, asdict(v))
    except OSError:
        pass


def read(run_dir: Path) -> Verdict | None:
    """The recorded verdict, or None when there is none (or it is damaged: it then says nothing)."""
    rec = read_json(Path(run_dir) / VERDICT_FILE, {})
    if rec.get("code") not in NAMES or not isinstance(rec.get("attempt"), int):
        return None
    try:
        return Verdict(**rec)
    except TypeError:  # fields missing or unknown
        return None


def of_this_launch(run_dir: Path) -> Verdict | None:
    """The verdict an earlier attempt of this torchrun launch recorded (a restart cannot change it), or None.
    Reads only: a start that is refused afterwards leaves the run directory as it was."""
    v, (launch, attempt) = read(run_dir), this_launch()
    if v is not None and launch and v.launch == launch and v.attempt < attempt:
        return v
    return None


def set_aside_stale(run_dir: Path) -> None:
    """Once a start is accepted: a record of an earlier launch (or a damaged one) is moved aside, so the
    next restart does not take it for this launch's. One written by a sibling rank of this very attempt is
    left for the launcher to read."""
    path = Path(run_dir) / VERDICT_FILE
    if not path.is_file():
        return
    v, (launch, attempt) = read(run_dir), this_launch()
    if v is not None and launch and v.launch == launch and (
            v.attempt < attempt or (v.attempt == attempt and _younger_than_this_process(path))):
        return
    set_aside(path)


def _younger_than_this_process(path: Path) -> bool:
    """Written after this process started: by a sibling rank of this attempt. A new launch that reuses a
    fixed run id is at attempt 0 too, and its predecessor's record is older than it."""
    try:
        return path.stat().st_mtime >= _STARTED - 1.0  # 1 s of slack for the clocks of other nodes
    except OSError:
        return False


_STARTED = time.time()  # the trainer imports this module at its start, before any verdict of its attempt


def set_aside(path: Path) -> Path | None:
    """verdict.json -> verdict.<its time>.json beside it; None when another rank moved it first (or the run
    directory cannot be written: the trainer's own checks say so next)."""
    try:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(path.stat().st_mtime))
        aside = path.with_name(f"verdict.{stamp}.json")
        os.replace(path, aside)
        return aside
    except OSError:
        return None
