"""The ``numafast`` command as a whole: a bare ``numafast``, --help, and node and CPU
lists in numactl's syntax (``numafast run`` checked by what the child's kernel reports)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from numafast import topology
from numafast._validate import parse_list
from numafast.cli import SUBCOMMANDS, main
from sysfs_truth import node_cpus, online_nodes

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}"}
REPORT = "import json, os; from sysfs_truth import thread_policy; print(json.dumps([sorted(os.sched_getaffinity(0)), thread_policy()]))"


def numafast(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "numafast", *args], capture_output=True, text=True,
                          cwd=TESTS.parent, env=ENV, timeout=300)  # fmt: skip


def child_placement(*options: str) -> tuple[list[int], list[object]]:
    result = numafast("run", *options, "--", sys.executable, "-c", REPORT)
    assert result.returncode == 0, result.stderr
    cpus, policy = json.loads(result.stdout)
    return cpus, policy


# ---------------------------------------------------------------- numactl's list syntax


@pytest.mark.host_only("parses text")
@pytest.mark.parametrize(
    ("text", "allowed", "expected"),
    [
        ("0-2,5", [0, 1, 2, 3, 4, 5], [0, 1, 2, 5]),
        ("all", [0, 2, 4], [0, 2, 4]),
        ("!2", [0, 2, 4], [0, 4]),
        ("!0-1,4", [0, 1, 2, 3, 4], [2, 3]),
        ("+0", [4, 6, 8], [4]),
        ("+1-2", [4, 6, 8], [6, 8]),
        ("!+0", [4, 6, 8], [6, 8]),
        (" 1 ", [0, 1], [1]),
    ],
)
def test_lists_read_as_numactl_reads_them(text: str, allowed: list[int], expected: list[int]) -> None:
    assert parse_list(text, allowed, "node") == expected


@pytest.mark.host_only("parses text")
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("3-1", "node list '3-1' is neither a number nor a range A-B with A <= B"),
        ("0-1-2", "node list '0-1-2' is neither a number nor a range"),
        ("0-", "node list '0-' is neither a number nor a range"),
        ("0,x", "node list 'x' in '0,x' is neither a number nor a range"),
        ("", "node list '' is empty"),
        ("!all", "node list '!all' leaves no node"),
        ("+3", "node list '+3': +3 counts past the 2 allowed nodes (0-1)"),
    ],
)
def test_malformed_lists_name_the_value_and_the_allowed_ones(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        parse_list(text, [0, 1], "node")
    assert "0-1" in str(raised.value)


@pytest.mark.host_only("CPU lists do not depend on the nodes; a minute under TCG")
def test_run_takes_numactls_cpu_list_syntax() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert child_placement("--physcpubind", "all")[0] == allowed
    assert child_placement("--physcpubind", f"+{len(allowed) - 1}")[0] == [allowed[-1]]
    if len(allowed) > 1:
        assert child_placement("--physcpubind", f"!{allowed[0]}")[0] == allowed[1:]


@pytest.mark.numa(nodes=4)
def test_run_takes_numactls_node_list_syntax() -> None:
    nodes = online_nodes()
    cpus, policy = child_placement("--cpunodebind", "+1", "--membind", f"!{nodes[0]}")
    assert cpus == node_cpus(nodes[1])
    assert policy == [2, nodes[1:]]  # MPOL_BIND on every node but the first
    assert child_placement("--interleave", "all")[1] == [3, nodes]


@pytest.mark.host_only("argparse refuses them before anything is bound")
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--membind", "3-1"], "argument --membind: node list '3-1' is neither a number nor a range A-B with A <= B"),
        (["--cpunodebind", "0-"], "argument --cpunodebind: node list '0-' is neither a number nor a range"),
        (["--physcpubind", "0-1-2"], "argument --physcpubind: cpu list '0-1-2' is neither a number nor a range"),
        (["--interleave", "!all"], "argument --interleave: node list '!all' leaves no node; allowed nodes: "),
        (["--gpu", "0", "--nproc-per-node", "0"], "argument --nproc-per-node: '0': give an integer >= 1"),
    ],
)
def test_run_refuses_malformed_lists_naming_the_value(options: list[str], message: str) -> None:
    result = numafast("run", *options, "--", "true")
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.host_only("reads a snapshot")
def test_plan_refuses_a_core_count_that_leaves_no_cpu_naming_the_option() -> None:
    result = numafast("plan", "--sysfs", str(TESTS / "fixtures" / "dgx-h100"), "--mode", "single", "--max-cores", "0")
    assert result.returncode == 2 and "argument --max-cores: '0': give an integer >= 1" in result.stderr


NO_GPUS = "no GPUs to plan for: "
NEEDS = ("so it needs GPUs that sysfs shows, or a snapshot of a machine with them (--sysfs ROOT, "
         "e.g. tests/fixtures/dgx-h100 in a numafast checkout)")  # a wheel ships no fixtures


def plan_output(capsys: pytest.CaptureFixture[str], *options: str) -> tuple[int, str, str]:
    code = main(["plan", *options])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.host_only("reads a snapshot")
@pytest.mark.parametrize("options", [[], ["--nproc-per-node", "2"], ["--mode", "single-unique", "--json"]])
def test_plan_without_gpus_says_so_once_and_what_it_needs(capsys: pytest.CaptureFixture[str], options: list[str]) -> None:
    root = str(TESTS / "fixtures" / "sparse-nodes")
    code, out, err = plan_output(capsys, "--sysfs", root, *options)
    assert (code, out) == (1, ""), out
    assert err.count(NO_GPUS) == 1 and f"the snapshot {root} has no GPU" in err and NEEDS in err, err


@pytest.mark.host_only("reads a snapshot")
def test_plan_says_when_cuda_visible_devices_hides_every_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan_output(capsys, "--sysfs", str(TESTS / "fixtures" / "dgx-h100"), "--cuda-visible-devices", "-1")
    assert (code, out) == (1, "") and NO_GPUS + "CUDA_VISIBLE_DEVICES hides all 8 GPUs of the snapshot" in err, err


@pytest.mark.host_only("the host has no GPU; the guests' answer is the same")
def test_plan_on_this_machine_without_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    if topology().gpus:
        pytest.skip("this machine has GPUs: plan has something to plan")
    code, out, err = plan_output(capsys)
    assert (code, out) == (1, "") and err.count(NO_GPUS + "this machine has no GPU") == 1 and NEEDS in err, err


@pytest.mark.host_only("reads a snapshot")
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--mode", "single", "--max-cores", "4"], "--max-cores 4 does nothing in mode single: it gives each rank one core"),
        (["--mode", "node", "--max-cores", "4"], "--max-cores 4 does nothing in mode node"),
        (["--mode", "exclusive", "--min-cores", "2"], "--min-cores 2 does nothing in mode exclusive"),
    ],
)
def test_plan_refuses_a_core_count_its_mode_would_ignore(
    capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    code, out, err = plan_output(capsys, "--sysfs", str(TESTS / "fixtures" / "dgx-h100"), *options)
    assert (code, out) == (1, "") and message in err, err


@pytest.mark.host_only("reads a snapshot")
def test_plan_applies_max_cores_where_the_mode_takes_it(capsys: pytest.CaptureFixture[str]) -> None:
    root = str(TESTS / "fixtures" / "dgx-h100")
    code, out, _ = plan_output(capsys, "--sysfs", root, "--mode", "all", "--max-cores", "4", "--smt", "one", "--json")
    assert code == 0 and [rank["cpus"] for rank in json.loads(out)["ranks"]] == [[0, 1, 2, 3]] * 4 + [[8, 9, 10, 11]] * 4
    assert plan_output(capsys, "--sysfs", root, "--mode", "single", "--max-cores", "1")[0] == 0


# ---------------------------------------------------------------- a bare numafast, --help


@pytest.mark.host_only("compares two outputs of show")
def test_a_bare_numafast_runs_show_and_says_so() -> None:
    bare, show = numafast(), numafast("show")

    def steady(text: str) -> list[str]:  # free memory changes from one run to the next
        return [line for line in text.splitlines() if "free" not in line]

    assert bare.returncode == 0 and steady(bare.stdout) == steady(show.stdout) and "node" in bare.stdout
    assert bare.stderr.startswith("numafast: no command given, running show (commands: show, plan, run, check, bench")
    assert "With no COMMAND, numafast runs show" in numafast("--help").stdout


@pytest.mark.host_only("reads the parsers")
def test_every_option_of_every_command_is_explained_in_its_help() -> None:
    parser = argparse.ArgumentParser(prog="numafast")
    subparsers = parser.add_subparsers(dest="command")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    for name, command in subparsers.choices.items():
        text = command.format_help()
        for action in command._actions:
            for option in action.option_strings:
                assert option in text, f"numafast {name} --help lacks {option}"
                assert action.help, f"numafast {name} {option} has no help text"
