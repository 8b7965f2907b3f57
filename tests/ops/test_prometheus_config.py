"""deploy/prometheus passes Prometheus' own checks: the config, the alert rules and their unit tests."""

from __future__ import annotations

import subprocess

from prometheus_tools import DEPLOY, binary


def _promtool(*args: str) -> str:
    done = subprocess.run(
        [binary("promtool"), *args],
        cwd=DEPLOY / "prometheus",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_config_is_valid() -> None:
    assert "SUCCESS" in _promtool("check", "config", "prometheus.yml")


def test_rules_are_valid() -> None:
    assert "SUCCESS" in _promtool("check", "rules", "kvherd-alerts.yml")


def test_alert_unit_tests_pass() -> None:
    assert "SUCCESS" in _promtool("test", "rules", "kvherd-alerts.test.yml")
