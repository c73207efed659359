"""What a machine file sets for ssh's command line (``-l user``, ``-p port``) is what ``Match
user`` and the ``%r``/``%p`` tokens see, as the live ``ssh -G -l -p`` shows."""

from __future__ import annotations

from pathlib import Path

from ssh_scheduler.machines.ssh_config import read_config_file
from ssh_scheduler.machines.ssh_resolve import resolve_host
from tests.ssh_reference import make_reference

CONFIG = "Match user alice\n  HostName matched\nHost gpu1\n  UserKnownHostsFile /k/%p-%r\n"


def test_a_preset_user_and_port_are_what_match_and_tokens_see(tmp_path: Path) -> None:
    ref = make_reference(tmp_path / "ref")
    config = tmp_path / "config"
    config.write_text(CONFIG)
    parsed = read_config_file(config, environ=ref.env)
    assert parsed is not None
    for user, port in (("alice", 2222), (None, None)):
        args = [*(["-l", user] if user else []), *(["-p", str(port)] if port else [])]
        status, theirs, stderr = ref.run("gpu1", config, *args)
        assert status == 0, stderr
        ours = resolve_host("gpu1", [parsed], ref.account, preset_user=user, preset_port=port, environ=ref.env)
        assert (ours.user, ours.hostname, str(ours.port)) == (theirs["user"][0], theirs["hostname"][0], theirs["port"][0])
        assert list(ours.known_hosts or ()) == theirs["userknownhostsfile"][0].split(" ")
    assert theirs["hostname"] == ["gpu1"] and ours.hostname == "gpu1"  # (no -l alice: no match)
