"""``oodviz run CONFIG --nproc-per-node N``: the run's worker on N processes through torch's elastic launcher.

This is ``torchrun [options] -m oodviz.pipeline.worker RUN_DIR --echo`` called in-process
(:func:`torch.distributed.run.run`), so every torchrun option keeps its meaning: one machine gets
``--standalone`` (a rendezvous on a free local port); several take ``--nnodes``, ``--node-rank`` and
``--rdzv-endpoint HOST:PORT`` (node 0's address), with the run directory on a filesystem every node
sees (``--out``). No worker is restarted (``--max-restarts 0``): a rank that fails fails the run.

``python -m oodviz.runs.launch RUN_DIR N`` runs an existing run directory on this machine's ``N`` processes: the
app's supervisor starts it instead of the one-process worker for a run on "all N GPUs".

When a rank fails, torch's agent stops the others and raises :class:`ChildFailedError`; :func:`launch`
then records the run ``failed`` with the rank that failed first, its exit code or signal, and what it
said (its ``rank`` event, :func:`rank_failure`).

Ctrl-C in the terminal reaches the launcher and every rank (one process group). Each rank takes SIGINT as a
cancel request (:func:`oodviz.pipeline.worker.main`): it stops at its next batch and rank 0 records the run
``cancelled``. The launcher's agent, told the same, passes SIGINT on to the ranks and waits for them; :func:`launch`
then raises :class:`Interrupted`, the run ``cancelled`` (recorded so by :func:`launch` too when no rank could).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from oodviz.runs.rundir import FINAL_STATES, RunDir

RUN_DIR_WAIT_S = 120.0  # how long a node other than 0 waits for node 0 to create the run directory


class Interrupted(Exception):
    """The launcher was told to stop (Ctrl-C: SIGINT; SIGTERM) while the ranks ran: ``signum``, and the run
    ``cancelled``."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def torchrun_argv(
    run_dir: Path, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None
) -> list[str]:
    """The ``torchrun`` arguments of one node of the run in ``run_dir``; ValueError for impossible options."""
    if nproc_per_node < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(
            f"need --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes; got "
            f"{nproc_per_node}, {nnodes}, {node_rank}"
        )
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError("a run on several nodes needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)")
    rendezvous = (
        ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-endpoint", rdzv_endpoint]
        if nnodes > 1
        else ["--standalone", "--nnodes", "1"]
    )
    return [
        *rendezvous,
        "--nproc-per-node",
        str(nproc_per_node),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.5",
        "-m",
        "oodviz.pipeline.worker",
        str(Path(run_dir).resolve()),
        "--echo",
    ]


def describe_failure(run: RunDir, error) -> str:
    """Which rank failed first and how (a ``ChildFailedError``), with what that rank said when it said something."""

    rank, failure = error.get_first_failure()
    code = failure.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    said = rank_failure(run)
    detail = f"; {said}" if said.startswith("rank ") else ""
    return f"rank {rank} (pid {failure.pid}) {how}{detail}"


def wait_for_run_dir(path: Path, timeout_s: float = RUN_DIR_WAIT_S) -> RunDir:
    """The run directory node 0 creates, once its ``config.json`` is there; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (path / "config.json").is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} has no config.json after {timeout_s:.0f}s: start node 0 with the same --out")
        time.sleep(0.2)
    return RunDir(path)


def launch(run: RunDir, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint=None) -> str:
    """Run ``run`` on this node's ``nproc_per_node`` processes (with the other nodes') and return its final state;
    :class:`Interrupted` when the launcher is told to stop (the run then ``cancelled``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    args = get_args_parser().parse_args(torchrun_argv(run.path, nproc_per_node, nnodes, node_rank, rdzv_endpoint))
    try:
        torchrun(args)
    except (SignalException, KeyboardInterrupt) as error:  # the agent has stopped the ranks (SIGINT: they cancelled)
        signum = error.sigval if isinstance(error, SignalException) else signal.SIGINT
        # SIGTERM reaches rank 0 as the agent's stop, which it records failed: the user asked for it, so cancelled
        run.write_status(
            only_if=lambda status: status.get("state") not in ("done", "cancelled"),
            state="cancelled",
            error=f"cancelled by {signal.Signals(signum).name} to the launcher; finished parts are kept",
            finished=time.time(),
        )
        raise Interrupted(signum) from None
    except ChildFailedError as error:
        first_rank = error.get_first_failure()[0]

        def not_recorded(status: dict) -> bool:  # rank 0 failing by itself has already said why
            return status.get("state") != "cancelled" and not (first_rank == 0 and status.get("state") == "failed")

        run.write_status(only_if=not_recorded, state="failed", error=describe_failure(run, error), finished=time.time())
    finally:
        if node_rank == 0:
            run.remove_scratch()
    state = run.read_status().get("state")
    return state if state in FINAL_STATES else "failed"


def main(argv: list[str]) -> int:
    """``RUN_DIR N``: exit status 0 when the run ended done or cancelled, else 1."""
    if len(argv) != 2 or not argv[1].isdigit() or int(argv[1]) < 1:
        print("usage: python -m oodviz.runs.launch RUN_DIR NPROC_PER_NODE", file=sys.stderr)
        return 2
    try:
        return 0 if launch(RunDir(Path(argv[0])), int(argv[1])) in ("done", "cancelled") else 1
    except Interrupted:  # recorded cancelled
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def rank_failure(run: RunDir) -> str:
    """What the last failed rank said in the events log, or a general reason when none has said anything."""
    failed = [e for e in run.read_events() if e.get("event") == "rank" and e.get("kind") == "failed"]
    if failed:
        return f"rank {failed[-1]['rank']} failed: {failed[-1].get('message')}"
    return "the launcher stopped rank 0 because another rank failed or was killed (see worker.log or torchrun's output)"
