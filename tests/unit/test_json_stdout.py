"""``--json``: stdout carries the JSON document only. A library that prints or logs to stdout meanwhile
(deepspeed's logger does, once transformers imports it while saving a model) goes to stderr instead."""

from __future__ import annotations

import json
import logging
import sys


def test_stray_stdout_writes_go_to_stderr_under_json(capsys):
    from rlctl.cli._output import json_only_stdout, print_json

    with json_only_stdout():
        print("[WARNING] Setting accelerator to CPU")  # a print
        handler = logging.StreamHandler(stream=sys.stdout)  # a logger created now, bound to "stdout"
        log = logging.getLogger("rlctl-test-noisy")
        log.addHandler(handler)
        log.warning("noisy library log line")
        log.removeHandler(handler)
        print_json({"ok": True})
    out, err = capsys.readouterr()
    assert json.loads(out) == {"ok": True}
    assert "Setting accelerator" in err and "noisy library log line" in err
    print("after")  # stdout is back
    assert capsys.readouterr().out == "after\n"


def test_cli_json_output_parses(capsys):
    from rlctl.cli.app import main

    assert main(["plugins", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plugins"]
