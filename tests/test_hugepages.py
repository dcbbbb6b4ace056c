"""Weights and KV caches on transparent huge pages (model/hugepages.py): the same values and sharing after the move,
a model that answers the same, the switch-off, and the KV arena."""

from __future__ import annotations

import pytest
import torch
from hf_utils import make_tiny_hf_model
from test_model import prefill_logits

from brisk.model import hugepages as H
from brisk.model.loader import load_model


@pytest.fixture
def huge_pages():  # noqa: ANN201
    """Huge pages switched on (whatever BRISK_HUGE_PAGES said at start-up) for the test, the settings restored."""
    with H.override(enabled=True) as s:
        yield s


def test_settings_read_once_from_the_environment():
    assert H.HugePageSettings.from_env({"BRISK_HUGE_PAGES": "0"}).enabled is False
    assert H.HugePageSettings.from_env({"BRISK_HUGE_PAGES": "1"}).enabled is True
    assert H.HugePageSettings.from_env({}).enabled is True


def test_to_huge_pages_keeps_values_sharing_and_outputs(tmp_path, huge_pages):
    make_tiny_hf_model(tmp_path, "llama", tie_word_embeddings=True)
    # bfloat16 from a float32 file: every weight is converted (none is a view of the mapped file, which stays put)
    H.configure(enabled=False)
    plain_loaded = load_model(str(tmp_path), dtype=torch.bfloat16)
    plain = plain_loaded.model
    H.configure(enabled=True)
    loaded = load_model(str(tmp_path), dtype=torch.bfloat16)  # moves the weights when huge pages are available
    model = loaded.model
    ids = torch.tensor([1, 5, 9, 2, 7, 3, 3, 8])
    assert torch.equal(prefill_logits(loaded, ids), prefill_logits(plain_loaded, ids))
    for (name, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    if not H.huge_pages_available():  # e.g. THP off on this kernel: nothing moved, nothing else to check
        return
    big = [p for p in model.parameters() if p.nbytes >= 4096]
    ptrs = sorted(p.data_ptr() for p in big)
    # one arena: the parameters lie within one contiguous span, in module order
    span = ptrs[-1] - ptrs[0]
    assert span < sum(p.nbytes for p in big) + 64 * len(big)
    # tied embeddings stay one tensor
    assert model.lm_head.weight is model.model.embed_tokens.weight or (
        model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr())
    # moving again is harmless (values unchanged)
    H.to_huge_pages(model)
    for (name, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_switch_off_and_kv_arena(huge_pages):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    before = [p.data_ptr() for p in model.parameters()]
    with H.override(enabled=False):
        assert not H.huge_pages_available()
        assert H.to_huge_pages(model) == 0 and H.huge_zeros(3, (2, 4), torch.float32) is None
    assert [p.data_ptr() for p in model.parameters()] == before
    assert H.settings.enabled  # the block's switch-off ended with it
    if not H.huge_pages_available():
        return
    caches = H.huge_zeros(4, (2, 8, 16, 3, 64), torch.bfloat16)  # 4 layers x 96 KiB
    assert caches is not None and len(caches) == 4
    assert all(c.shape == (2, 8, 16, 3, 64) and c.dtype == torch.bfloat16 and not c.any() for c in caches)
    assert all(c.data_ptr() % 64 == 0 for c in caches)
    assert caches[0].data_ptr() % H.HUGE_PAGE == 0  # the arena starts on a huge page
    caches[1].fill_(1)  # separate tensors
    assert not caches[0].any() and not caches[2].any()


def test_aliasing_views_stay_together(huge_pages):
    # two buffers viewing one storage (a slice of the other) are left where they are: moving them apart would
    # break the aliasing; an ordinary parameter next to them still moves
    if not H.huge_pages_available():
        return
    module = torch.nn.Linear(64, 64)
    base = torch.arange(4096, dtype=torch.float32)
    module.register_buffer("whole", base)
    module.register_buffer("part", base[1024:2048])
    weight_ptr = module.weight.data_ptr()
    assert H.to_huge_pages(module) > 0
    assert module.weight.data_ptr() != weight_ptr  # moved
    assert module.whole.data_ptr() == base.data_ptr()  # not moved
    module.whole[1024] = -1.0
    assert module.part[0] == -1.0  # still the same storage
