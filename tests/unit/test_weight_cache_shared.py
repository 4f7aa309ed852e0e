"""A tensor one component hands another (``ZImageControlNetModel.from_transformer`` sets the
transformer's pad tokens on the ControlNet) follows the weight cache's binding under both names: the
second name never keeps the first load's host buffer mapped, eviction and reload rebind it, and
the tensor is loaded before the model runs (the other component reads it where no hook waits)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from libs.dataplane.loader import Loader
from libs.protocol.ids import ModelKey

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def loader() -> Iterator[Loader]:
    with Loader() as loader:
        yield loader


def _bound_in(value: torch.Tensor, storage: torch.Tensor | None) -> bool:
    if storage is None:
        return False
    lo = storage.data_ptr()
    return lo <= value.data_ptr() < lo + storage.numel()


def test_a_parameter_shared_into_another_component_is_rebound_with_its_own_layer(
    tmp_path: Path, loader: Loader
) -> None:
    from diffusers.configuration_utils import ConfigMixin, register_to_config
    from diffusers.models.modeling_utils import ModelMixin

    from libs.models.common import load_component
    from services.executor.weights import WeightCache

    class Base(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, dim: int = 8, depth: int = 3) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(depth))
            self.pad_token = torch.nn.Parameter(torch.empty(1, dim))

    class Control(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, dim: int = 8) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(dim, dim)
            self.pad_token: torch.nn.Parameter | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) + self.pad_token

    torch.manual_seed(0)
    base, control = Base(), Control()
    torch.nn.init.normal_(base.pad_token)
    base.save_pretrained(tmp_path / "base")
    control.save_pretrained(tmp_path / "control")
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = control.proj(x) + base.pad_token

    base = load_component(Base, str(tmp_path / "base"), None, "cpu", loader)
    control = load_component(Control, str(tmp_path / "control"), None, "cpu", loader)
    control.pad_token = base.pad_token  # as from_transformer does
    cache = WeightCache("cpu", 0, loader=loader)
    key = ModelKey("control", "tiny")
    vm = cache.add(key, {"control": control, "base": base})
    (slot,) = [s for s in vm.slots if any(t.attr == "pad_token" for t in s.tensors)]
    assert [vm.slots[i] for i in vm.direct] == [slot]  # no hook of Base's waits for it in Control
    for resident in (len(vm.slots), 0, 1, len(vm.slots)):
        cache.trim(key, resident)
        job, report = cache.begin(key)
        try:
            with torch.no_grad():
                out = control(x)
        finally:
            cache.end(key, job, report)
        assert torch.equal(out, expected), resident
        assert control.pad_token is base._parameters["pad_token"], resident
        assert _bound_in(control.pad_token, slot.storage), resident
    cache.trim(key, 0)
    assert control.pad_token is base._parameters["pad_token"]
    assert control.pad_token.stride() == (0, 0) and torch.isnan(control.pad_token).all()
