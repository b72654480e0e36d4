"""The two-host helper says why it cannot make namespaces (so the e2e test skips with that reason)."""

from __future__ import annotations

import subprocess

import pytest

from tests.deploy import netns
from tests.deploy.netns import NamespacesUnavailable, make_two_hosts


def test_without_root(monkeypatch, tmp_path):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(NamespacesUnavailable, match="need root"):
        make_two_hosts("t", tmp_path)


def test_without_iproute2(monkeypatch, tmp_path):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    with pytest.raises(NamespacesUnavailable, match="iproute2"):
        make_two_hosts("t", tmp_path)


def test_when_the_kernel_refuses_nothing_is_left_behind(monkeypatch, tmp_path):
    calls = []

    def refuse(*args, check=True):
        calls.append(args)
        if args[:2] == ("netns", "add") and check:
            raise subprocess.CalledProcessError(1, ["ip", *args], stderr="mount --make-shared /run/netns failed: "
                                                "Operation not permitted")
        return subprocess.CompletedProcess(["ip", *args], 0, "", "")

    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: "/usr/sbin/ip")
    monkeypatch.setattr(netns, "_ip", refuse)
    with pytest.raises(NamespacesUnavailable, match="Operation not permitted"):
        make_two_hosts("t", tmp_path)
    assert not any(c[:2] == ("netns", "del") for c in calls)  # it created none, so it deletes none
