"""NumaLoader inside training frameworks: Lightning, Accelerate, Transformers' Trainer,
Ray Train, each a 2-rank CPU job (gloo) run by a script of tests/frameworks/ with and
without numafast (the user's one-line change).

Each rank writes, per training step, the sample ids it got and what the kernel says of
the batch (tests/frameworks/common.py); its DataLoader workers write their CPUs and
memory policy. The tests check, for every rank, epoch and step:

* the same sample ids with numafast as without, and, in both runs, the two ranks'
  shards disjoint and together the whole dataset in each epoch, reshuffled each epoch;
* with numafast, each batch's data tensor in a ``numafast-pool-node<N>`` memfd
  mapping (/proc/self/maps) that is locked (smaps' VmFlags), every page of it mlocked
  (kpageflags), where a GPU is usable (lock="auto"; without one, not locked at all),
  and on node N (pagemap),
  the workers that made it mapping that memfd too, and numafast's stats for the loader
  the framework iterates saying the workers collated it there (only a loader's first
  batches, sent before its pool existed, may be copied);
* the DataLoader workers' CPUs and memory policy the node's.

The jobs of all the selected host tests start together (their ranks mostly wait, on
each other and on the frameworks' start); each test then waits for its own and checks
it. Every test but the Accelerate one with a node per rank is host-only: a framework's
import costs half a minute per process in a TCG guest. A job's output, and each rank's
records (JSON), stay in pytest's temporary directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sysfs_truth import nearest_cpu_nodes, node_cpus, online_nodes

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "frameworks"
IN_GUEST = os.environ.get("NUMAFAST_GUEST") == "1"
# A job's, a guard against a hang. In the guest its 2 ranks alone take ~2 minutes to
# import. On the host every job starts at once (host_jobs) beside CI's TCG guest: there
# Ray's local cluster once took 3.5 minutes to start (two startup timeouts), and its job
# of two runs was killed at 300 s ten seconds into its second run.
TIMEOUT_S = 600
SAMPLES, BATCH, WORKERS, EPOCHS = 96, 8, 2, 2
STEPS_PER_EPOCH = SAMPLES // 2 // BATCH
MPOL_DEFAULT = 0
HOST_ONLY = "a 2-rank framework job: each process imports torch and the framework, ~30 s apiece under TCG"


def installed(modules: tuple[str, ...]) -> bool:
    """Whether these modules can be imported (found, not imported: a framework's import is slow)."""
    return all(importlib.util.find_spec(m.split(".")[0]) is not None for m in modules) and all(
        importlib.util.find_spec(m) is not None for m in modules if "." in m
    )


def needs(*modules: str) -> None:
    """Skip, naming what is missing, unless these modules are installed."""
    missing = [module for module in modules if not installed((module,))]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install 'numafast[frameworks]')")


# ---------------------------------------------------------------- running a job


@dataclass
class Run:
    """One 2-rank job, started in its own session (so that a timeout ends all of it)."""

    label: str
    name: str
    out: Path
    command: list[str]
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    started: float = 0.0
    seconds: float = 0.0
    returncode: int | None = None
    started_with: tuple[Path, dict[str, str]] | None = None

    def start(self, tmp: Path, env: dict[str, str]) -> Run:
        self.started_with = (tmp, env)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = self.out / f"{self.name}.log"
        environment = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
        if IN_GUEST:  # gloo finds its address from the hostname, which the guest cannot resolve
            environment.setdefault("GLOO_SOCKET_IFNAME", "lo")
        environment.pop("MASTER_PORT", None)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(self.command, cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.monotonic()
        return self

    def finish(self) -> Run:
        assert self.process is not None
        if self.returncode is not None:
            return self
        try:
            self.returncode = self.process.wait(max(1.0, TIMEOUT_S - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # the session this job started in
            self.process.wait()
            self.returncode = -9
        self.seconds = time.monotonic() - self.started
        return self

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log is not None and self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def baseline_ranks(self) -> list[dict[str, Any]]:
        """A job without numafast, the reference: its ranks, from a second run where the
        first hung. The stock loader has no guard against a worker stuck inside os.fork()
        (CPython gh-112275, before 3.11.8), the hang NumaLoader's start watch replaces the
        worker for (test_lightning_ddp_numaloader_again); numafast's jobs get no second run."""
        self.finish()
        if self.returncode == -9 and self.started_with is not None:
            for stale in self.out.glob(f"{self.name}.rank*.json"):
                stale.unlink()
            self.returncode = None
            self.start(*self.started_with)
        return self.ranks()

    def ranks(self, name: str | None = None) -> list[dict[str, Any]]:
        """Rank 0's and rank 1's records; fails naming what went wrong where the job did."""
        self.finish()
        stem = name or self.name
        timed_out = f" (killed after {TIMEOUT_S} s)" if self.returncode == -9 else ""
        records = []
        for rank in range(2):
            path = self.out / f"{stem}.rank{rank}.json"
            if not path.exists():
                pytest.fail(f"{self.label}: rank {rank} wrote no records; the job exited {self.returncode}{timed_out}; "
                            f"its output ends:\n{self.tail()}")
            record = json.loads(path.read_text())
            if record["error"]:
                pytest.fail(f"{self.label}: rank {rank} raised:\n{record['error'][-3000:]}")
            records.append(record)
        if self.returncode != 0:
            pytest.fail(f"{self.label}: the job exited {self.returncode}{timed_out}; its output ends:\n{self.tail()}")
        return records


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def script(name: str, *arguments: str, launcher: str = "python") -> list[str]:
    """The command that runs a script of tests/frameworks/: itself ("python"), or as 2 ranks
    under torchrun ("torchrun": a static rendezvous on the loopback address, as a guest's
    hostname resolves to nothing) or under tests/frameworks/two_ranks.py ("two ranks": the
    same environment, without the agent process that costs a torch import under TCG)."""
    command = [sys.executable]
    if launcher == "torchrun":
        command += ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    elif launcher == "two ranks":
        command += [str(SCRIPTS / "two_ranks.py")]
    return [*command, str(SCRIPTS / name), *arguments]


def start_all(runs: list[Run], tmp: Path, env: dict[str, str] | None = None) -> dict[str, Run]:
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    for run in runs:
        run.start(tmp / "tmp", env or {})
    return {run.name: run for run in runs}


# ---------------------------------------------------------------- what the records must say


def step_label(label: str, rank: int, step: dict[str, Any]) -> str:
    return f"{label}: rank {rank} epoch {step['epoch']} step {step['step']}"


def check_shards(label: str, ranks: list[dict[str, Any]]) -> None:
    """Each epoch: 6 steps of 8 whole samples per rank, the ranks' shards disjoint and
    together the dataset, and each rank's order different from the epoch before."""
    orders: dict[int, list[list[int]]] = {}
    for rank, record in enumerate(ranks):
        assert record["rank"] == rank and record["world"] == 2, f"{label}: rank {rank} says it is {record['rank']} of {record['world']}"
        for step in record["steps"]:
            assert step["content_ok"], f"{step_label(label, rank, step)}: a sample's tensor is not full of its id ({step['ids']})"
            assert len(step["ids"]) == BATCH, f"{step_label(label, rank, step)}: {len(step['ids'])} samples, not {BATCH}"
        for epoch in range(EPOCHS):
            ids = [i for step in record["steps"] if step["epoch"] == epoch for i in step["ids"]]
            steps = sum(1 for step in record["steps"] if step["epoch"] == epoch)
            assert steps == STEPS_PER_EPOCH, (
                f"{label}: rank {rank} epoch {epoch}: {steps} steps ({len(ids)} samples); a rank's shard is "
                f"{STEPS_PER_EPOCH} steps of {BATCH} (every rank iterating the whole dataset gives {2 * STEPS_PER_EPOCH})"
            )
            orders.setdefault(rank, []).append(ids)
    for epoch in range(EPOCHS):
        first, second = orders[0][epoch], orders[1][epoch]
        both = set(first) & set(second)
        assert not both, f"{label}: epoch {epoch}: ranks 0 and 1 both got samples {sorted(both)}"
        missing = set(range(SAMPLES)) - set(first) - set(second)
        assert not missing, f"{label}: epoch {epoch}: no rank got samples {sorted(missing)}"
    for rank in range(2):
        assert orders[rank][0] != orders[rank][1], f"{label}: rank {rank} got the same order in both epochs (no reshuffle)"


def compare(label: str, without: list[dict[str, Any]], ours: list[dict[str, Any]]) -> None:
    """The same sample ids, rank by rank, epoch by epoch, step by step."""
    for rank in range(2):
        stock_steps, our_steps = without[rank]["steps"], ours[rank]["steps"]
        for stock, step in zip(stock_steps, our_steps):
            where = step_label(label, rank, step)
            assert (stock["epoch"], stock["step"]) == (step["epoch"], step["step"]), (
                f"{where}: without numafast this was epoch {stock['epoch']} step {stock['step']}"
            )
            assert step["ids"] == stock["ids"], f"{where}: sample ids {step['ids']}, without numafast {stock['ids']}"
        assert len(our_steps) == len(stock_steps), (
            f"{label}: rank {rank}: {len(our_steps)} steps with numafast, {len(stock_steps)} without"
        )


def expected_cpus(node: int) -> list[int]:
    return sorted(cpu for near in nearest_cpu_nodes(node) for cpu in node_cpus(near))


def _gpu_usable() -> bool:
    try:
        from numafast import cuda
    except ImportError:
        return False
    return cuda.usable()


# Whether the ranks' pools are page-locked: NumaLoader's lock="auto" locks where a GPU is usable.
LOCKS = _gpu_usable()


def check_numafast(label: str, ranks: list[dict[str, Any]], nodes: list[int] | None = None, *, pages: bool = False) -> None:
    """Every batch in a pool of the rank's node (locked where a GPU is usable: LOCKS), collated there by workers that run
    on the node with its memory policy; ``pages``: pagemap must name each page's node."""
    for rank, record in enumerate(ranks):
        node = nodes[rank] if nodes is not None else None
        for step in record["steps"]:
            where, x = step_label(label, rank, step), step["x"]
            assert x["in_pool"], (
                f"{where}: the batch's data tensor is in {x['mapping']!r}, not a numafast-pool-node memfd "
                f"(the loader the framework iterates: {', '.join(record['loaders'])})"
            )
            if node is None:
                node = x["node"]
            assert x["node"] == node, f"{where}: the batch is in a node-{x['node']} pool, the rank's loader is on node {node}"
            assert x["locked"] == LOCKS, (
                f"{where}: the batch's pages are {'not all' if LOCKS else ''} mlocked (lock='auto' locks "
                f"{'where a GPU is usable, as here' if LOCKS else 'nothing without a usable GPU'}): VmFlags {x['vmflags']!r}, {x['rss_bytes']} of "
                f"{x['mapping_bytes']} bytes resident, Locked {x['locked_bytes']} of Pss {x['pss_bytes']}"
                f"{', ' + x['locked_error'] if 'locked_error' in x else ''}"
            )
            if pages:
                assert x["pages_nodes"] is not None, f"{where}: pagemap could not say where the pages are: {x.get('pages_nodes_error')}"
            if x["pages_nodes"] is not None:
                assert set(x["pages_nodes"]) <= {node}, f"{where}: the batch's pages are on nodes {x['pages_nodes']}, not {node}"
        assert node is not None, f"{label}: rank {rank} took no step"
        copying = check_stats(label, rank, record, node)
        for step in record["steps"]:
            if step["epoch"] in copying and step["step"] < FIRST_BATCHES:
                continue  # a new loader's first batches, copied in: their worker maps the pool only once listed
            unmapped = [pid for pid, maps in step["x"]["workers_map_it"].items() if maps is False]
            assert not unmapped, (
                f"{step_label(label, rank, step)}: the DataLoader worker {', '.join(unmapped)} that made the batch does "
                "not map the pool it is in (/proc/PID/maps): the batch was not collated there by the worker"
            )
        check_workers(label, rank, record, node)


def check_workers(label: str, rank: int, record: dict[str, Any], node: int) -> None:
    workers = record["workers"]
    assert len(workers) >= WORKERS, f"{label}: rank {rank}: {len(workers)} DataLoader workers recorded themselves, not {WORKERS} or more"
    cpus = expected_cpus(node)
    for worker in workers:
        who = f"{label}: rank {rank}: DataLoader worker {worker['worker_id']} (pid {worker['pid']})"
        assert worker["cpus"] == cpus, f"{who} may run on CPUs {worker['cpus']}, node {node}'s are {cpus}"
        assert worker["policy_mode"] != MPOL_DEFAULT and worker["policy_nodes"] == [node], (
            f"{who} has memory policy mode {worker['policy_mode']} nodes {worker['policy_nodes']}, not node {node}'s"
        )


# The batches a new loader's workers collate before the owner made its pool: they come the
# copying way, and the owner's copy of the first makes the pool (prefetch_factor x workers).
FIRST_BATCHES = 2 * WORKERS


def check_stats(label: str, rank: int, record: dict[str, Any], node: int) -> set[int]:
    """numafast's count of how the batches came, epoch by epoch, for the loader the
    framework iterates (numafast.torch.loader_stats; the NumaLoader's own stats until it
    exists): every batch collated in the pool by the workers but a new loader's first
    ones (FIRST_BATCHES at most), copied in; the epochs that copied some."""
    key = "stats" if record["loader_stats_available"] else "own_stats"
    previous: dict[str, Any] | None = None
    landed = 0
    copying = set()
    for epoch in range(EPOCHS):
        entry = record["epochs"][str(epoch)]
        stats, where = entry[key], f"{label}: rank {rank} epoch {epoch}"
        assert stats is not None, f"{where}: numafast.torch.loader_stats() finds no numafast in the {entry['loader']} the framework iterates"
        assert "error" not in stats, f"{where}: numafast.torch.loader_stats({entry['loader']}) raised {stats['error']}"
        copied_before = previous["copied"] if previous is not None and stats["batches"] > previous["batches"] else 0
        copied = stats["copied"] - copied_before
        assert set(stats["fallbacks"]) <= {"first batches"} and copied <= FIRST_BATCHES, (
            f"{where}: {copied} of the loader's batches this epoch were copied by the main process, not collated in "
            f"the pool by the workers, beyond a new loader's first {FIRST_BATCHES}: {stats['fallbacks']}"
        )
        if copied:
            copying.add(epoch)
        assert stats["node"] == node, f"{where}: the loader's stats say node {stats['node']}, its batches are on node {node}"
        assert stats["landed"] + stats["copied"] == stats["batches"], f"{where}: landed + copied != batches in {stats}"
        own = entry.get("own_stats")
        if own is not None and key == "stats":  # the NumaLoader the user made counts what the framework's copy did
            assert (own["batches"], own["landed"]) == (stats["batches"], stats["landed"]), (
                f"{where}: the user's own NumaLoader counts {own['batches']} batches, {own['landed']} landed; the "
                f"{entry['loader']} the framework iterates counts {stats['batches']}, {stats['landed']} landed"
            )
        this_epoch = sum(1 for step in record["steps"] if step["epoch"] == epoch)
        so_far = sum(1 for step in record["steps"] if step["epoch"] <= epoch)
        if previous is not None and stats["batches"] == so_far:  # the same loader as the epoch before
            landed += stats["landed"] - previous["landed"]
        elif stats["batches"] == this_epoch:  # a loader of this epoch's own
            landed += stats["landed"]
        else:
            pytest.fail(f"{where}: the loader's stats count {stats['batches']} batches; the training step got "
                        f"{this_epoch} this epoch, {so_far} in all ({stats})")
        previous = stats
    assert landed > 0, f"{label}: rank {rank}: no batch landed in the pool"
    return copying


# ---------------------------------------------------------------- the jobs

ACCELERATE_VARIANTS = {
    "prepare-wrapped": "accelerator.prepare(NumaLoader(dl))",
    "wrap-prepared": "NumaLoader(accelerator.prepare(dl))",
}


def lightning_jobs(tmp: Path) -> list[Run]:
    runs = []
    for variant in ("plain", "reload", "fork"):
        for numafast in (False, True):
            name = f"lightning-{variant}-{'numafast' if numafast else 'without'}"
            arguments = ["--out", str(tmp / name), "--name", name, "--variant", variant, *(["--numafast"] if numafast else [])]
            runs.append(Run(f"Lightning {variant}, {'with' if numafast else 'without'} numafast", name, tmp / name,
                            script("lightning_run.py", *arguments)))
    return runs


LIGHTNING_AGAIN = 2  # the plain run with numafast, this many times more


def lightning_again_jobs(tmp: Path) -> list[Run]:
    runs = []
    for again in range(1, LIGHTNING_AGAIN + 1):
        name = f"lightning-plain-numafast-again{again}"
        arguments = ["--out", str(tmp / name), "--name", name, "--variant", "plain", "--numafast"]
        runs.append(Run(f"Lightning plain with numafast, again ({again})", name, tmp / name,
                        script("lightning_run.py", *arguments)))
    return runs


def accelerate_run(tmp: Path, name: str, variant: str | None, launcher: str = "torchrun") -> Run:
    arguments = ["--out", str(tmp / name), "--name", name]
    if variant is not None:
        arguments += ["--numafast", "--variant", variant]
    label = f"Accelerate {ACCELERATE_VARIANTS[variant]}" if variant else "Accelerate without numafast"
    return Run(label, name, tmp / name, script("accelerate_run.py", *arguments, launcher=launcher))


def accelerate_jobs(tmp: Path) -> list[Run]:
    return [accelerate_run(tmp, "accelerate-without", None),
            *(accelerate_run(tmp, f"accelerate-{variant}", variant) for variant in ACCELERATE_VARIANTS)]


def transformers_jobs(tmp: Path) -> list[Run]:
    runs = []
    for numafast in (False, True):
        name = f"transformers-{'numafast' if numafast else 'without'}"
        arguments = ["--out", str(tmp / name), "--name", name, *(["--numafast"] if numafast else [])]
        runs.append(Run(f"Transformers Trainer {'with' if numafast else 'without'} numafast", name, tmp / name,
                        script("hf_run.py", *arguments, launcher="torchrun")))
    return runs


def ray_jobs(tmp: Path) -> list[Run]:
    # Both runs in one Ray cluster: its start is the slow part.
    return [Run("Ray Train", "ray", tmp / "ray", script("ray_run.py", "--out", str(tmp / "ray"), "--name", "ray",
                                                        "--variant", "both"))]


# test function -> (its jobs, the modules they need)
JOBS = {
    "test_ray_train_numaloader": (ray_jobs, ("torch", "ray.train")),
    "test_lightning_ddp_numaloader": (lightning_jobs, ("torch", "lightning")),
    "test_lightning_ddp_numaloader_again": (lightning_again_jobs, ("torch", "lightning")),
    "test_accelerate_numaloader": (accelerate_jobs, ("torch", "accelerate")),
    "test_transformers_trainer_numaloader": (transformers_jobs, ("torch", "transformers", "accelerate")),
}


@pytest.fixture(scope="module")
def host_jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every job the selected host tests need, started at once (their ranks mostly wait on
    each other and on the frameworks' start), each test then waiting for its own."""
    selected = {getattr(item, "originalname", None) for item in request.session.items
                if getattr(item, "module", None) is request.module and not item.get_closest_marker("skip")}
    tmp = tmp_path_factory.mktemp("frameworks")
    runs = [run for test, (jobs, modules) in JOBS.items() if test in selected and installed(modules) for run in jobs(tmp)]
    started = start_all(runs, tmp)
    yield started
    for run in runs:  # a test that failed early left its other runs going
        if run.returncode is None and run.process is not None and run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.process.wait()


def job(host_jobs: dict[str, Run], test: str, name: str) -> Run:
    needs(*JOBS[test][1])
    return host_jobs[name]


# ---------------------------------------------------------------- Lightning


@pytest.mark.host_only(HOST_ONLY)
@pytest.mark.parametrize("variant", ["plain", "reload", "fork"])
def test_lightning_ddp_numaloader(host_jobs: dict[str, Run], variant: str) -> None:
    """Trainer(strategy="ddp", devices=2, accelerator="cpu"); train_dataloader() returns
    NumaLoader(DataLoader(...)); "reload": reload_dataloaders_every_n_epochs=1; "fork":
    strategy="ddp_fork", the loader made and its first batch peeked at before fit (a
    notebook user's run: the ranks inherit a loader their parent iterated)."""
    test = "test_lightning_ddp_numaloader"
    without = job(host_jobs, test, f"lightning-{variant}-without").baseline_ranks()
    check_shards(f"Lightning {variant} without numafast (the baseline)", without)
    label = f"Lightning {variant} with numafast"
    ours = job(host_jobs, test, f"lightning-{variant}-numafast").ranks()
    check_shards(label, ours)
    compare(label, without, ours)
    check_numafast(label, ours)


@pytest.mark.host_only(HOST_ONLY)
@pytest.mark.parametrize("again", range(1, LIGHTNING_AGAIN + 1))
def test_lightning_ddp_numaloader_again(host_jobs: dict[str, Run], again: int) -> None:
    """The plain run again: workers forked each epoch in both ranks, while gloo's and
    torch's threads run. One such run in 16 once hung for good (a worker stuck inside
    os.fork(), CPython gh-112275); NumaLoader's start watch replaces such a worker, so
    every run ends, within the job's timeout, with every step's batch landed."""
    test = "test_lightning_ddp_numaloader_again"
    label = f"Lightning plain with numafast, again ({again})"
    ours = job(host_jobs, test, f"lightning-plain-numafast-again{again}").ranks()
    check_shards(label, ours)
    check_numafast(label, ours)


# ---------------------------------------------------------------- Accelerate


@pytest.mark.host_only(HOST_ONLY)
@pytest.mark.parametrize("variant", list(ACCELERATE_VARIANTS))
def test_accelerate_numaloader(host_jobs: dict[str, Run], variant: str) -> None:
    """torchrun --nproc-per-node 2; Accelerator(cpu=True); both ways of adding numafast."""
    test = "test_accelerate_numaloader"
    without = job(host_jobs, test, "accelerate-without").baseline_ranks()
    check_shards("Accelerate without numafast (the baseline)", without)
    run = job(host_jobs, test, f"accelerate-{variant}")
    ours = run.ranks()
    check_shards(run.label, ours)
    compare(run.label, without, ours)
    check_numafast(run.label, ours)


@pytest.mark.numa(nodes=4)
def test_accelerate_prepare_numaloader_on_a_node_per_rank(tmp_path: Path) -> None:
    """accelerator.prepare(NumaLoader(dl, node=...)) with rank 0's loader on one node and
    rank 1's on another: each rank's batches, every page of them, on its own node, and
    its workers on that node's CPUs. Kept small for the TCG guest: no run without
    numafast (the host test compares with one), no torchrun agent."""
    needs("torch", "accelerate")
    cpu_nodes = [node for node in online_nodes() if node_cpus(node)]
    nodes = cpu_nodes[1:3] if len(cpu_nodes) >= 3 else cpu_nodes[:2]
    run = accelerate_run(tmp_path, "accelerate-prepare-wrapped", "prepare-wrapped", launcher="two ranks")
    start_all([run], tmp_path, {"FRAMEWORK_NODES": ",".join(map(str, nodes))})
    label = f"Accelerate accelerator.prepare(NumaLoader(dl, node=...)), ranks on nodes {nodes}"
    ours = run.ranks()
    check_shards(label, ours)
    check_numafast(label, ours, nodes, pages=True)


# ---------------------------------------------------------------- Transformers


@pytest.mark.host_only(HOST_ONLY)
def test_transformers_trainer_numaloader(host_jobs: dict[str, Run]) -> None:
    """A Trainer whose get_train_dataloader() returns NumaLoader(super().get_train_dataloader())."""
    test = "test_transformers_trainer_numaloader"
    without = job(host_jobs, test, "transformers-without").baseline_ranks()
    check_shards("Transformers Trainer without numafast (the baseline)", without)
    run = job(host_jobs, test, "transformers-numafast")
    ours = run.ranks()
    check_shards(run.label, ours)
    compare(run.label, without, ours)
    check_numafast(run.label, ours)


# ---------------------------------------------------------------- Ray Train


@pytest.mark.host_only(HOST_ONLY)
def test_ray_train_numaloader(host_jobs: dict[str, Run]) -> None:
    """A local Ray cluster, TorchTrainer with 2 CPU workers; in the loop
    ray.train.torch.prepare_data_loader(NumaLoader(dl)). Both runs share one cluster."""
    run = job(host_jobs, "test_ray_train_numaloader", "ray")
    without = run.ranks("ray-without")
    check_shards("Ray Train without numafast (the baseline)", without)
    label = "Ray Train prepare_data_loader(NumaLoader(dl))"
    ours = run.ranks("ray-numafast")
    check_shards(label, ours)
    compare(label, without, ours)
    check_numafast(label, ours)
