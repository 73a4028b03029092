"""worker/malloc.py: after keep_freed_buffers, a large freed buffer is reused, not re-faulted."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from tokenmill.worker.malloc import keep_freed_buffers

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _faults_of_a_filled_buffer(nbytes: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)  # touch every page
    del buf
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc
def test_a_step_sized_buffer_is_reused_without_page_faults() -> None:
    assert keep_freed_buffers()
    nbytes = 96 << 20  # above glibc's largest adaptive mmap threshold (32 MiB)
    _faults_of_a_filled_buffer(nbytes)  # the first time its pages fault in
    again = _faults_of_a_filled_buffer(nbytes)
    assert again < (nbytes >> 12) // 10, again  # under a tenth of its 4 KiB pages
