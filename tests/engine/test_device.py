"""``--dtype auto`` on the CPU: bf16 where the CPU has it, float32 elsewhere, and a warning for a
named bf16 whose matmuls would be emulated (an info line where tokenfleet's bf16 kernel takes them)."""

import logging
import math

import pytest
import torch

from tokenfleet.engines.native import device
from tokenfleet.engines.native.linear import bf16 as bf16_linear


def test_auto_is_bf16_where_the_cpu_has_it_without_timing_anything(monkeypatch, caplog):
    # whether its matmuls are the faster is the engine's business (cpu_linear routes them)
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: True)
    monkeypatch.setattr(device, "bf16_matmul_speed", lambda: pytest.fail("select_dtype timed matmuls"))
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        assert device.select_dtype("auto", torch.device("cpu")) is torch.bfloat16
    assert not caplog.text


def test_auto_without_native_bf16_is_float32_and_a_named_dtype_is_taken_as_is(monkeypatch, caplog):
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(bf16_linear, "bf16_kernel_available", lambda: False)  # no AVX-512 or AVX2, say
    monkeypatch.setattr(device, "bf16_matmul_speed", lambda: 0.15)
    with caplog.at_level(logging.WARNING, logger="tokenfleet.engines.native.device"):
        assert device.select_dtype("auto", torch.device("cpu")) is torch.float32
        assert not caplog.text
        assert device.select_dtype("float32", torch.device("cpu")) is torch.float32
        assert not caplog.text
        assert device.select_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert "without bf16 instructions" in caplog.text and "0.15x" in caplog.text


def test_a_named_bf16_without_native_bf16_but_with_the_bf16_kernel_only_informs(monkeypatch, caplog):
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(bf16_linear, "bf16_kernel_available", lambda: True)  # an Ice Lake Xeon, say
    monkeypatch.setattr(device, "bf16_matmul_speed", lambda: 0.1)
    with caplog.at_level(logging.INFO, logger="tokenfleet.engines.native.device"):
        assert device.select_dtype("auto", torch.device("cpu")) is torch.float32
        assert device.select_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "tokenfleet's bf16 kernel" in caplog.text and "0.10x" in caplog.text


def test_a_named_bf16_is_quiet_where_the_cpu_has_it(monkeypatch, caplog):
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: True)
    with caplog.at_level(logging.WARNING, logger="tokenfleet.engines.native.device"):
        assert device.select_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert not caplog.text


def test_the_measurement_is_a_ratio_of_two_real_timings():
    # Only its form: a lone timing on a shared machine can be off by any factor (CI once saw
    # 0.0006 at this size), so the value itself is never asserted.
    speed = device.bf16_matmul_speed(rows=8, size=128, rounds=2)
    assert isinstance(speed, float) and math.isfinite(speed) and speed > 0
