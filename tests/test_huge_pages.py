"""Held tensors in transparent huge pages (``cpu.huge_pages``): the copy is the tensor, bit
for bit; its whole 2 MiB pages lie in a mapping advised for huge pages wherever the kernel
offers them (read back from /proc/self/smaps); elsewhere, and for small tensors, the tensor
itself; the grouped layout as the op's modules hold it is ``group_layout``'s, in such pages."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from whisper_sparse.cpu import huge_pages
from whisper_sparse.cpu.grouped_layout import group_for_op, group_layout
from whisper_sparse.format.bitmask import compress_bitmask

offered = pytest.mark.skipif(
    not huge_pages.huge_pages_offered(), reason="this kernel offers no transparent huge pages"
)


def mapping_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@offered
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32, torch.uint8])
def test_the_copy_is_the_tensor_in_pages_advised_for_huge_pages(dtype):
    """A 5 MiB tensor (two whole huge pages and a part) comes back equal, contiguous, of its
    shape and dtype, at a 2 MiB boundary, in a mapping advised ``hg`` (MADV_HUGEPAGE); the
    mapping outlives every name but the copy's."""
    numel = (5 * 2**20 + 12) // torch.empty(0, dtype=dtype).element_size()
    source = torch.randint(0, 100, (numel // 4, 4)).to(dtype)
    held = huge_pages.in_huge_pages(source[:, :])
    assert held.data_ptr() != source.data_ptr()
    assert held.dtype == dtype and held.shape == source.shape and held.is_contiguous()
    assert held.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert "hg" in mapping_flags(held.data_ptr())
    expected = source.clone()
    del source
    gc.collect()
    assert torch.equal(held, expected)
    held.add_(1)  # writable, as a loaded parameter's storage is
    assert torch.equal(held, expected + 1)


def test_small_tensors_and_kernels_without_huge_pages_keep_the_tensor(monkeypatch):
    """Below one huge page, or where the kernel offers none, the tensor itself comes back."""
    small = torch.zeros(huge_pages.HUGE_PAGE_BYTES // 2 - 1, dtype=torch.int16)
    assert huge_pages.in_huge_pages(small) is small
    large = torch.zeros(huge_pages.HUGE_PAGE_BYTES, dtype=torch.uint8)
    monkeypatch.setattr(huge_pages, "huge_pages_offered", lambda: False)
    assert huge_pages.in_huge_pages(large) is large


def test_the_setting_is_read_from_its_bracketed_word(monkeypatch, tmp_path):
    """``always`` and ``madvise`` offer huge pages to an advised region, ``never`` does not,
    and a kernel without the setting offers none."""
    setting = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "_SETTING", setting)
    for text, expected in [
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
    ]:
        setting.write_text(text)
        huge_pages.huge_pages_offered.cache_clear()
        assert huge_pages.huge_pages_offered() is expected
    setting.unlink()
    huge_pages.huge_pages_offered.cache_clear()
    assert huge_pages.huge_pages_offered() is False
    monkeypatch.undo()
    huge_pages.huge_pages_offered.cache_clear()


def test_the_held_grouped_layout_is_group_layouts():
    """``group_for_op`` gives ``group_layout``'s tensors, bit for bit; where huge pages are
    offered its values (over 2 MiB here) lie in an advised mapping."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(1024, 4096, generator=generator).to(torch.bfloat16)
    weight[torch.rand(weight.shape, generator=generator) < 0.5] = 0
    stored = compress_bitmask(weight)
    held = group_for_op(*stored, 4096)
    for built, kept in zip(group_layout(*stored, 4096), held, strict=True):
        assert torch.equal(built, kept)
    large = [t for t in held[:2] if t.numel() * t.element_size() >= huge_pages.HUGE_PAGE_BYTES]
    assert len(large) == 1  # the values (4 MiB; the masks take 512 KiB)
    if huge_pages.huge_pages_offered():
        assert "hg" in mapping_flags(large[0].data_ptr())
