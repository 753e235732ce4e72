"""tools/generate.py, the README's first command, on the embedded default model."""

import sys

from tools import generate


def run_generate(monkeypatch, capsys, *args) -> str:
    monkeypatch.setattr(sys, "argv", ["generate.py", "--prompt", "def add(a, b):", *args])
    generate.main()
    return capsys.readouterr().out


def test_it_prints_the_completion_and_its_rates(monkeypatch, capsys):
    out = run_generate(monkeypatch, capsys, "--max-tokens", "8", "--ignore-eos")
    assert "--- completion (length) ---" in out
    assert out.splitlines()[-1].startswith("8 tokens in ") and "tokens per forward" in out


def test_no_tokens_asked_prints_no_rate_per_forward(monkeypatch, capsys):
    """It divided by the forwards, which are none."""
    out = run_generate(monkeypatch, capsys, "--max-tokens", "0")
    assert out.splitlines()[-1].startswith("0 tokens in ") and "no tokens per forward" in out


def test_it_takes_the_servers_decoding_flags(monkeypatch, capsys):
    out = run_generate(monkeypatch, capsys, "--max-tokens", "8", "--ignore-eos", "--decoding-strategy",
                       "joint_threshold", "--decoding-preset", "speed", "--buffer-size", "2")
    assert out.splitlines()[-1].startswith("8 tokens in ")
    out = run_generate(monkeypatch, capsys, "--max-tokens", "8", "--ignore-eos", "--strategy", "fixed_steps",
                       "--denoising-steps", "8")
    per_forward = float(out.splitlines()[-1].split(": ")[-1].split()[0])
    assert 0 < per_forward <= 1  # fixed_steps with as many steps as the block (8) has tokens: one a step at most
