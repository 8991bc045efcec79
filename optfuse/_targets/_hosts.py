"""The machines the compile targets come in: their host memory, host link and peak FLOP/s.

``offload="state"`` and ``"params"`` move bytes from the accelerator's memory to the memory of
the machine it sits in, so whether a model fits depends on that machine too. ``HOSTS`` lists
the machines a user rents or is given for each target of the registry, with the host memory
its provider states and where that figure comes from; a figure no stored public page states is
``None`` ("not found"), never a guess. ``CHIPS`` lists the figures of the transfer model
(``optfuse._analysis._offload_cost``): each chip's peak dense matmul FLOP/s and its host link's
bandwidth each way, with their sources.

A machine's memory is an upper bound on what the offloaded arrays may use: the operating system,
the Python process, the runtime and the input pipeline take some of it.
"""

from __future__ import annotations

from typing import NamedTuple

GB = 10**9
GiB = 2**30

_TPU_V5E = "https://cloud.google.com/tpu/docs/v5e"
_A3 = "https://cloud.google.com/compute/docs/accelerator-optimized-machines"
_SKYPILOT_GCP = ("https://raw.githubusercontent.com/skypilot-org/skypilot-catalog/master/"
                 "catalogs/v8/gcp/vms.csv")


class Host(NamedTuple):
  """A machine a target comes in.

  Attributes:
    machine: how its provider names it ("Cloud TPU v5e-1 VM (ct5lp-hightpu-1t)").
    target: the registry target of its accelerator ("tpu-v5e").
    memory_bytes: its host memory for one accelerator, or ``None`` when no source was found.
    source: where ``memory_bytes`` comes from: a URL and what it states.
  """

  machine: str
  target: str
  memory_bytes: int | None
  source: str


HOSTS: tuple[Host, ...] = (
    Host("Colab TPU v5e-1 runtime", "tpu-v5e", None,
         "not found: Colab's documentation states no host memory for its TPU runtimes"),
    Host("Cloud TPU v5e-1 VM (v5litepod-1, ct5lp-hightpu-1t)", "tpu-v5e", 48 * GB,
         f"{_TPU_V5E} (VM types: ct5lp-hightpu-1t, 24 vCPUs, 48 GB RAM per VM)"),
    Host("Colab T4 runtime (standard RAM)", "t4", int(12.7 * GB),
         "https://github.com/googlecolab/colabtools/issues/4134 (\"12.7 GB of System RAM\", as "
         "Colab's resource panel shows it; Colab's documentation states no figure)"),
    Host("GCP g2-standard-* (1 L4)", "l4", None,
         f"not found: {_A3} lists the G2 machine types, but no stored copy shows their memory"),
    Host("GCP a2-highgpu-1g (1 A100 40GB)", "a100-40gb", 85 * GiB,
         f"{_SKYPILOT_GCP} (a2-highgpu-1g: 12 vCPUs, 85.0 GiB, from the Compute Engine API)"),
    Host("GCP a2-ultragpu-1g (1 A100 80GB)", "a100-80gb", 170 * GiB,
         "https://huggingface.co/spaces/Elfsong/gcp_allocator (a2-ultragpu-1g: 12 vCPUs, "
         "memory 170; a third-party table of Compute Engine's machine types)"),
    Host("GCP a3-highgpu-1g (1 H100)", "h100", None,
         f"not found: {_A3} states the A3 series' 1,872 GB for 8 GPUs (a3-highgpu-8g), not "
         "the 1-GPU type's"),
    Host("GCP a3-highgpu-8g, per H100 (1,872 GB / 8)", "h100", 1872 * GB // 8,
         f"{_A3} (A3: 208 vCPUs and 1,872 GB of memory for 8 H100s)"),
)


def hosts_of(target: str) -> tuple[Host, ...]:
  """The machines of ``HOSTS`` whose accelerator is ``target`` (its topology ignored)."""
  base = target.partition(":")[0]
  return tuple(h for h in HOSTS if h.target == base)


def holds(host: Host, need: int | None) -> bool | None:
  """Whether ``host``'s memory holds ``need`` bytes; ``None`` when either is unknown."""
  if host.memory_bytes is None or need is None:
    return None
  return need <= host.memory_bytes


class Chip(NamedTuple):
  """The transfer model's figures for one target.

  Attributes:
    target: the registry target.
    name: the chip, in words.
    peak_flops: its peak dense matmul FLOP/s in bf16 (T4: fp16, it has no bf16).
    flops_source: where ``peak_flops`` comes from.
    link_bytes_per_s: its host link's bandwidth each way, or ``None`` when not published.
    link_source: where ``link_bytes_per_s`` comes from.
  """

  target: str
  name: str
  peak_flops: float
  flops_source: str
  link_bytes_per_s: float | None
  link_source: str


_KLOCKWOOD = "https://glennklockwood.com/garden/processors"
CHIPS: dict[str, Chip] = {c.target: c for c in (
    Chip("tpu-v5e", "TPU v5e", 197e12, f"{_TPU_V5E} (peak compute per chip, bf16: 197 TFLOPs)",
         None, f"not found: {_TPU_V5E} states compute, HBM and ICI, no host link"),
    Chip("t4", "T4", 65e12, "https://sysrqmts.com/en/gpus/nvidia/tesla/t4 (FP16: 65.13 TFLOPS; "
         "the T4 has no bf16)", 16 * GB,
         "the same page (PCIe 3.0 x16): 16 GB/s each way, PCIe 3.0's rate"),
    Chip("l4", "L4", 121e12, "https://grokipedia.com/page/NVIDIA_L4_vs_L40S (242 TFLOPS FP16 "
         "tensor with sparsity: half that dense)", 32 * GB,
         "https://pcpartcomparison.com/gpu/tesla-t4-vs-l4 (PCIe 4.0 x16): 32 GB/s each way, "
         "PCIe 4.0's rate"),
    Chip("a100-40gb", "A100 SXM 40GB", 312e12, f"{_KLOCKWOOD}/A100 (BF16 matrix: 312 TFLOPS, "
         "from NVIDIA's datasheet)", 32 * GB, f"{_KLOCKWOOD}/A100 (32+32 GB/s PCIe Gen4)"),
    Chip("a100-80gb", "A100 SXM 80GB", 312e12, f"{_KLOCKWOOD}/A100 (BF16 matrix: 312 TFLOPS, "
         "from NVIDIA's datasheet)", 32 * GB, f"{_KLOCKWOOD}/A100 (32+32 GB/s PCIe Gen4)"),
    Chip("h100", "H100 SXM", 989e12, f"{_KLOCKWOOD}/h100 (BF16 matrix: 989.4 TFLOPS dense)",
         64 * GB, f"{_KLOCKWOOD}/h100 (128 GB/s PCIe Gen5 both ways: 64 GB/s each way)"),
)}
