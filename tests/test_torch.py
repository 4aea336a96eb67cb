"""numafast.torch and torch tensors in mbind / migrate / page_nodes / placement."""

from __future__ import annotations

import gc
import re
import subprocess
import sys

import numpy as np
import pytest

from sysfs_truth import PAGE_SIZE, online_nodes, pagemap_nodes, pinned_to_one_cpu, vma_of

torch = pytest.importorskip("torch")

import numafast  # noqa: E402
import numafast.torch  # noqa: E402

NODE = online_nodes()[0]


def nodes_of(tensor: torch.Tensor) -> set[int | None]:
    return set(pagemap_nodes(tensor.data_ptr(), tensor.numel() * tensor.element_size()))


def whole_page_nodes(tensor: torch.Tensor) -> set[int | None]:
    """Truth for the pages wholly inside ``tensor`` (those mbind and migrate act on)."""
    start = -(-tensor.data_ptr() // PAGE_SIZE) * PAGE_SIZE
    end = (tensor.data_ptr() + tensor.nbytes) // PAGE_SIZE * PAGE_SIZE
    return set(pagemap_nodes(start, end - start))


@pytest.mark.host_only("reads the package's sources")
def test_the_torch_layer_imports_one_way_along_the_batchs_path() -> None:
    # worker side (collate) -> message <- owner side (pools); loader and hook use both.
    from pathlib import Path

    from import_graph import import_cycles

    assert import_cycles(Path(numafast.torch.__file__).parent, "numafast.torch") == []


@pytest.mark.host_only("an import check: the same on any kernel (a Python child, ~12 s under TCG)")
def test_importing_numafast_never_imports_torch() -> None:
    code = "import sys, numafast, numafast.memory, numafast.pages; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_empty_is_a_contiguous_cpu_tensor_on_its_node(dtype) -> None:  # type: ignore[no-untyped-def]
    tensor = numafast.torch.empty(64, 1024, dtype=dtype, node=NODE)
    assert tensor.shape == (64, 1024) and tensor.dtype == dtype and tensor.is_contiguous()
    assert tensor.device.type == "cpu" and not tensor.any()
    assert nodes_of(tensor) == {NODE}
    assert numafast.page_nodes(tensor) == numafast.PageNodes({NODE: len(pagemap_nodes(tensor.data_ptr(), tensor.nbytes))})


def test_zeros_takes_a_size_tuple_and_the_default_dtype() -> None:
    with pinned_to_one_cpu() as node:
        tensor = numafast.torch.zeros((3, 5))
    assert nodes_of(tensor) == {node}
    assert tensor.shape == (3, 5) and tensor.dtype == torch.get_default_dtype() and not tensor.any()
    with pytest.raises(numafast.InvalidSizeError):
        numafast.torch.empty(3, 0)


@pytest.mark.parametrize(("name", "dtype"), [("float32", torch.float32), ("torch.uint8", torch.uint8), ("bfloat16", torch.bfloat16)])
def test_empty_takes_a_dtype_by_name(name: str, dtype: torch.dtype) -> None:
    tensor = numafast.torch.empty(np.int64(16), 1024, dtype=name, node=np.int64(NODE))
    assert tensor.dtype == dtype and tensor.shape == (16, 1024)
    assert nodes_of(tensor) == {NODE}


@pytest.mark.parametrize("dtype", ["flaot32", "Tensor", 3, np.float32])
def test_empty_refuses_what_is_no_torch_dtype_naming_it(dtype: object) -> None:
    # A name went to dtype.itemsize: AttributeError: 'str' object has no attribute 'itemsize'.
    with pytest.raises(TypeError, match=re.escape(f"dtype {dtype!r} is not a torch dtype; give a torch.dtype or its name: 'float32'")):
        numafast.torch.empty(16, dtype=dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.quint8, "qint8", torch.qint32, "torch.quint4x2"])
def test_empty_refuses_a_quantized_dtype_naming_it(dtype: object) -> None:
    # Old code: torch.frombuffer of a quantized dtype, a segmentation fault.
    with pytest.raises(TypeError, match=r"dtype torch\.q\w+ is quantized: .*\(torch\.quantize_per_tensor\)"):
        numafast.torch.empty(16, dtype=dtype)  # type: ignore[arg-type]


def test_a_tensor_view_keeps_the_memory_and_shares_it_without_copy() -> None:
    tensor = numafast.torch.empty(1 << 20, dtype=torch.uint8, node=NODE)
    start = tensor.data_ptr()
    view = tensor[4096:8192].view(torch.int32)
    as_numpy = tensor.numpy()
    del tensor
    gc.collect()
    view.fill_(7)
    assert as_numpy[4096] == 7  # the same memory
    del as_numpy
    assert vma_of(start) is not None
    del view
    gc.collect()
    assert vma_of(start) is None


def test_mbind_migrate_and_placement_take_tensors() -> None:
    tensor = torch.ones(256, 1024)
    numafast.mbind(tensor, NODE)
    assert numafast.migrate(tensor, NODE) == 0
    assert whole_page_nodes(tensor) == {NODE}
    report = numafast.placement({"x": tensor, "y": [tensor.t()]}, node=NODE)
    assert list(report.leaves) == ["['x']"] and "not contiguous" in report.skipped["['y'][0]"]
    grad = torch.ones(100_000, requires_grad=True)
    numafast.mbind(grad, NODE)
    # mbind places the whole pages; the partial ones at the ends stay where first touched.
    assert whole_page_nodes(grad) == {NODE}


def test_tensors_that_are_not_one_span_of_host_memory_are_rejected() -> None:
    cases = [
        (torch.ones(64, 64).t(), "not contiguous"),
        (torch.ones(0), "empty"),
        (torch.empty(10, device="meta"), "not in host memory"),
        (torch.ones(10, 10).to_sparse(), "sparse"),
    ]
    for tensor, message in cases:
        with pytest.raises(numafast.InvalidBufferError, match=message):
            numafast.mbind(tensor, NODE)


@pytest.mark.numa(nodes=2)
def test_empty_lands_on_every_node() -> None:
    for node in online_nodes():
        tensor = numafast.torch.empty(256, 1024, dtype=torch.float32, node=node)
        assert nodes_of(tensor) == {node}, f"node {node}"
