"""meta.json names what a run was measured on: its figures vary with the host's CPU units as much as with code."""

from __future__ import annotations

import os

import torch

from zddrl.learner.runlog import CPU_UNITS, describe_hardware, hardware, run_metadata


def test_run_metadata_names_the_cpu_its_cores_and_the_units_that_set_the_learners_speed() -> None:
    found = run_metadata()["hardware"]
    assert found == hardware()
    assert found["cpu"] and found["logical_cores"] == os.cpu_count()
    assert found["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    caps = torch.cpu.get_capabilities()
    assert found["cpu_units"] == sorted(u for u in CPU_UNITS if caps.get(u))
    assert ("gpus" in found) == torch.cuda.is_available()


def test_the_hardware_line_says_when_a_cpu_has_no_amx() -> None:
    base = {"cpu": "Intel Xeon", "logical_cores": 2, "torch_cpu_capability": "AVX512"}
    without = describe_hardware({**base, "cpu_units": ["avx512_bf16"]})
    assert without == "measured on Intel Xeon, 2 logical cores, torch AVX512, units: avx512_bf16 (no AMX)"
    with_amx = describe_hardware({**base, "cpu_units": ["amx_bf16", "amx_tile"], "gpus": ["NVIDIA H200"]})
    assert "(no AMX)" not in with_amx and with_amx.endswith("units: amx_bf16, amx_tile; GPUs: NVIDIA H200")
