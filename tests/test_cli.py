"""The ``numafast`` command as a whole: a bare ``numafast``, --help, node and CPU lists
in numactl's syntax (``numafast run`` checked by what the child's kernel reports), and
what ``numafast show`` says this process may do (under a real seccomp filter for a
refusal: tests/seccomp_exec.c)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from numafast import TopologyWarning, capabilities, topology
from numafast._validate import parse_list
from numafast.cli import SUBCOMMANDS, main
from sysfs_truth import node_cpus, online_nodes
from test_policy_seccomp import under_seccomp  # noqa: F401  (the fixture)

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


# ---------------------------------------------------------------- what placing imports


# What a process that only places itself imports, and every name numafast exports.
IMPORTS = """
import sys
import numafast, numafast.cli
heavy = sorted(name for name in ("numpy", "numafast.memory", "numafast.pages", "numafast.pool", "numafast.cli.bench.measure")
               if name in sys.modules)
print(heavy, [name for name in numafast.__all__ if getattr(numafast, name, None) is None])
"""


@pytest.mark.host_only("an import check: the same on any kernel")
def test_placing_imports_neither_numpy_nor_the_pools_and_every_export_resolves() -> None:
    """``import numafast`` and the command (``numafast run``, a launcher's rank) leave
    NumPy, memory, pages, pools and the bench's measuring for their first use (with
    them, ``import numafast`` took 402 ms here, 164 ms without). Each exported name
    still resolves, imported as first named."""
    result = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[] []"]


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


@pytest.mark.host_only("argparse refuses them before anything is bound")
@pytest.mark.parametrize("options", [["run", "--membind", "0-70000"], ["run", "--physcpubind", "0-70000"], ["bench", "--nodes", "0-70000"]])
def test_a_list_of_ids_no_kernel_has_is_a_usage_error(capsys: pytest.CaptureFixture[str], options: list[str]) -> None:
    """The list parser refuses ids past any kernel's (0-99999999999 was counted out: a
    MemoryError traceback): the CLI says so as argparse does."""
    with pytest.raises(SystemExit) as exit:
        main([*options, "--", "true"] if options[0] == "run" else options)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and f"argument {options[1]}: " in err and "'0-70000' names ids up to 70000" in err, err


@pytest.mark.host_only("reads a snapshot")
def test_show_warns_about_damaged_gpu_files_and_cuda_visible_devices(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = tmp_path / "gh200"
    shutil.copytree(TESTS / "fixtures" / "gh200", root)
    (root / "proc/driver/nvidia/gpus/0009:01:00.0/information").write_text("GPU UUID: GPU-0a\nBus Location: zz:qq:00.0\n")
    with pytest.warns(TopologyWarning, match="'zz:qq:00.0' is not a PCI address"):
        assert main(["show", "--sysfs", str(root)]) == 0
    with pytest.warns(TopologyWarning, match="'--1' .* is not a device"):
        assert main(["show", "--sysfs", str(TESTS / "fixtures" / "dgx-h100"), "--cuda-visible-devices=--1"]) == 0
    capsys.readouterr()
    live = subprocess.run([sys.executable, "-m", "numafast", "show"], capture_output=True, text=True, cwd=TESTS.parent,
                          env={**ENV, "CUDA_VISIBLE_DEVICES": "--1"}, timeout=300)  # fmt: skip
    assert live.returncode == 0 and "'--1' (position 0) is not a device" in live.stderr, live.stderr


@pytest.mark.host_only("reads a snapshot")
def test_the_commands_warnings_say_the_command_not_a_file_and_line() -> None:
    """A warning of ``numafast show`` reads as its errors do: ``numafast show: Category:
    message``, not the console script's line or ``<frozen runpy>:88`` under ``python -m``."""
    result = numafast("show", "--sysfs", str(TESTS / "fixtures" / "damaged"))
    said = result.stderr.splitlines()
    assert result.returncode == 0 and said, result.stderr
    assert all(line.startswith("numafast show: TopologyWarning: ") for line in said), result.stderr
    assert any(line.endswith("cpulist: contains NUL bytes; reading only what precedes the first one") for line in said)


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
        (["--mode", "all", "--min-cores", "5", "--max-cores", "2"], "--min-cores 5 exceeds --max-cores 2: no rank can"),
    ],
)
def test_plan_refuses_a_core_count_its_mode_would_ignore(
    capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    code, out, err = plan_output(capsys, "--sysfs", str(TESTS / "fixtures" / "dgx-h100"), *options)
    assert (code, out) == (2, "") and err.startswith("usage: numafast plan") and f"numafast plan: error: {message}" in err, err


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


# ---------------------------------------------------------------- show: what this process may do

PERMITS = "placement this process may do (numafast.capabilities(), kernel "
EVERY_FEATURE = "numa, set_mempolicy, preferred_many, weighted_interleave, cpu_affinity, mbind, move_pages"


def capability_block(text: str) -> list[str]:
    """The lines of ``numafast show``'s output from its capabilities block on."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(PERMITS)]
    assert len(starts) == 1, text
    return lines[starts[0]:]


@pytest.mark.host_only("the host permits every placement call; a guest's older kernel may lack a policy mode")
def test_show_says_this_process_may_do_all_placement(capsys: pytest.CaptureFixture[str]) -> None:
    found = capabilities()
    if not all(getattr(found, name).available for name in EVERY_FEATURE.split(", ")):
        pytest.skip(f"this machine refuses some placement, so show cannot say all of it:\n{found}")
    assert main(["show"]) == 0
    kernel = os.uname().release
    assert capability_block(capsys.readouterr().out) == [PERMITS + f"{kernel}):", "  all of it: " + EVERY_FEATURE]
    assert main(["show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["capabilities"]
    assert shown.pop("kernel") == kernel and list(shown) == EVERY_FEATURE.split(", ")
    assert all(item == {"available": True, "reason": "", "errno": 0} for item in shown.values()), shown
    # A snapshot is another machine's: nothing of this process is said with it.
    snapshot = str(TESTS / "fixtures" / "dgx-h100")
    assert main(["show", "--sysfs", snapshot]) == 0 and PERMITS not in capsys.readouterr().out
    assert main(["show", "--sysfs", snapshot, "--json"]) == 0
    assert "capabilities" not in json.loads(capsys.readouterr().out)


# `python3 -m numafast ARGS` as a program for the seccomp filter's python3 -c: run as -m runs it.
AS_M = ("import runpy, sys; sys.argv = ['numafast', *{args!r}]; "
        "runpy.run_module('numafast', run_name='__main__', alter_sys=True)")  # fmt: skip


@pytest.mark.host_only("seccomp refusals: the same whatever the nodes")
def test_show_names_what_a_seccomp_filter_refuses_and_the_fix(under_seccomp) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    # Docker's default profile without CAP_SYS_NICE refuses these two, and more (test_container_placement.py).
    result = under_seccomp("set_mempolicy,mbind", AS_M.format(args=["show"]))
    assert result.returncode == 0, result.stderr
    block = capability_block(result.stdout)
    assert block[1] == "  yes: numa, cpu_affinity, move_pages", block
    assert block[2] == "  no: set_mempolicy, preferred_many, weighted_interleave, mbind", block
    why = block[3].strip()
    assert why.startswith("set_mempolicy, mbind refused with EPERM; a container's seccomp profile"), why
    assert "(seccomp: filter active, no CAP_SYS_NICE)" in why and "run with --cap-add SYS_NICE" in why, why
    assert block[4].startswith("  so NumaLoader's workers and pinned pools run unplaced: "), block
    assert len(block) == 5, block
    result = under_seccomp("set_mempolicy,mbind", AS_M.format(args=["show", "--json"]))
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)["capabilities"]
    assert [name for name in EVERY_FEATURE.split(", ") if not shown[name]["available"]] == [
        "set_mempolicy", "preferred_many", "weighted_interleave", "mbind"
    ]  # fmt: skip
    mbind = shown["mbind"]
    assert mbind["errno"] == errno.EPERM and mbind["reason"].startswith("mbind refused with EPERM; "), mbind
