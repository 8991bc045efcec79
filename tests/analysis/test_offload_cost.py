"""The offload transfer model (``optfuse._analysis._offload_cost``) and the machines it reads
(``optfuse._targets._hosts``): every figure cites its source, a step's bytes come from its plan,
its FLOPs from the decoder's matmuls, and the transfer hides from the batch whose matmuls outlast
it."""

import optax

from optfuse import _fuse
from optfuse._analysis import _offload_cost
from optfuse._targets import _hosts, _registry
from optfuse.bench import _models
from optfuse.bench._fit_table import TINY_DECODER
from optfuse.bench._models import DecoderConfig


def test_every_machine_states_its_host_memory_with_a_source_or_says_not_found():
  for host in _hosts.HOSTS:
    assert host.target in _registry.SPECS, host
    if host.memory_bytes is None:
      assert host.source.startswith("not found"), host
    else:
      assert "https://" in host.source and not host.source.startswith("not found"), host
  # The machines the issue names: Colab's TPU v5e-1 and T4, a TPU v5e-1 VM, the L4, A100 and
  # H100 VMs.
  assert {h.target for h in _hosts.HOSTS} == {"tpu-v5e", "t4", "l4", "a100-40gb", "a100-80gb",
                                              "h100"}
  vm = next(h for h in _hosts.hosts_of("tpu-v5e:1x1") if "ct5lp-hightpu-1t" in h.machine)
  assert vm.memory_bytes == 48 * 10**9
  assert _hosts.holds(vm, 48 * 10**9) is True and _hosts.holds(vm, 48 * 10**9 + 1) is False
  assert _hosts.holds(vm, None) is None
  assert _hosts.holds(_hosts.hosts_of("l4")[0], 1) is None  # its memory was not found


def test_every_chip_of_the_transfer_model_cites_its_peak_and_its_link():
  for chip in _hosts.CHIPS.values():
    assert chip.target in _registry.SPECS and chip.peak_flops > 1e13, chip
    assert "https://" in chip.flops_source, chip
    assert (chip.link_bytes_per_s is None) == chip.link_source.startswith("not found"), chip
  assert {h.target for h in _hosts.HOSTS} <= set(_hosts.CHIPS)


def test_a_host_param_row_is_read_twice_and_written_once_a_state_row_once_each_way():
  assert _offload_cost.moved_bytes(param_bytes=0, other_bytes=10) == (10, 10)  # state only
  assert _offload_cost.moved_bytes(param_bytes=4, other_bytes=10) == (18, 14)


def test_the_plan_gives_the_host_params_and_the_other_host_bytes_of_each_offload_choice():
  c = TINY_DECODER
  model = _models.decoder(c, scanned=True, remat=True)
  params, batch = _models.abstract(model.params), _models.abstract(model.batch)
  total, stacks = _models.grad_bytes(model.params), _models.grad_bytes(model.params["layers"])
  expected = {("state", "backward"): (0, 2 * total),           # AdamW's mu and nu
              ("state", "forward"): (0, 3 * total),            # and the pending gradient
              ("params", "backward"): (stacks, 2 * total),     # the loop stacks too
              ("params", "forward"): (stacks, 3 * total)}
  for (offload, mode), want in expected.items():
    fx = _fuse.fuse(optax.adamw(1e-3), mode=mode, offload=offload)
    assert _offload_cost.plan_bytes(fx, model.loss, params, batch) == want, (offload, mode)


def test_the_step_flops_count_every_matmul_of_the_decoder_forward_recompute_and_backward():
  c = DecoderConfig(layers=2, dim=4, heads=1, ff=8, vocab=10, seq=3, batch=5)
  layer = 2 * (4 * 12 + 4 * 4 + 4 * 8 + 8 * 4) + 4 * 3 * 4   # qkv, proj, up, down; attention
  head = 2 * 4 * 10
  tokens = 5 * 3
  assert _offload_cost.step_flops(c, remat=False) == tokens * 3 * (2 * layer + head)
  assert _offload_cost.step_flops(c) == tokens * (4 * 2 * layer + 3 * head)
  # The batch scales the FLOPs, not the bytes: the hiding batch is their ratio.
  assert _offload_cost.step_flops(c._replace(batch=10)) == 2 * _offload_cost.step_flops(c)


def test_the_transfer_hides_from_the_batch_whose_matmuls_outlast_it():
  chip = _hosts.Chip("x", "x", peak_flops=2e12, flops_source="", link_bytes_per_s=1e9,
                     link_source="")
  moved = _offload_cost.Moved(reads=5e9, writes=1e9)            # 5 s each way (reads)
  cost = _offload_cost.cost(moved, flops=2e12, chip=chip)        # 1 s of matmuls at batch 1
  assert cost.transfer_s == 5.0 and cost.matmul_s == 1.0 and cost.hiding_batch == 5
  assert cost.link_needed == 5e9                                 # the link that hides it now
  assert _offload_cost.cost(moved, flops=20e12, chip=chip).hiding_batch == 1
  unknown = chip._replace(link_bytes_per_s=None)
  assert _offload_cost.cost(moved, 2e12, unknown) == (None, 1.0, None, 5e9)
