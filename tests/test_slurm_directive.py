"""The Slurm comment directive (``schemas.slurm``) and how ``trainguard launch`` applies it
(``launch_args.slurm_directive`` / ``apply_directive``): a table per outcome, no Slurm."""
from __future__ import annotations

import json
import subprocess

import pytest

from trainguard.launch import args as launch_args
from trainguard.schemas.slurm import (DIRECTIVE_FIELDS, DirectiveError, SlurmDirective,
                                      directive_or_default, parse_directive)


@pytest.mark.parametrize("comment,expected", [
    ('{"trainguard":{"mode":"observe"}}', SlurmDirective(mode="observe")),
    ('{"trainguard":{"mode":"action","retry_budget":3,"min_world_size":4,"spares":1,'
     '"job":"llm-7b"}}', SlurmDirective("action", 3, 4, 1, "llm-7b")),
    ('  {"trainguard": {}}  ', SlurmDirective()),
    ('{"trainguard":{"retry_budget":0}, "other_tool": {"x": 1}}', SlurmDirective(retry_budget=0)),
    ('{"trainguard":{"job":"ip-10-0-1-2.train"}}', SlurmDirective(job="ip-10-0-1-2.train")),
])
def test_a_valid_directive(comment, expected):
    assert parse_directive(comment) == expected


@pytest.mark.parametrize("comment", [
    None, "", "   ", "just a note", "(null)", '{"owner": "team-a"}', "[1, 2]", "42",
    '{"note": "not for us"}',
])
def test_no_directive(comment):
    assert parse_directive(comment) is None
    assert directive_or_default(comment) == (None, "")


@pytest.mark.parametrize("comment,field,words", [
    ('{"trainguard": {"mode": "acton"', "", "not JSON"),             # cut short
    ("trainguard: please watch", "", "not JSON"),
    ('["trainguard"]', "", "a JSON list"),
    ('{"trainguard": "action"}', "", "holds a JSON str"),
    ('{"trainguard": {"mode": "acton"}}', "mode", "not 'observe' or 'action'"),
    ('{"trainguard": {"mode": 1}}', "mode", "not a JSON string"),
    ('{"trainguard": {"retry_budget": "3"}}', "retry_budget", "not a JSON integer"),
    ('{"trainguard": {"retry_budget": 2.5}}', "retry_budget", "not a JSON integer"),
    ('{"trainguard": {"retry_budget": true}}', "retry_budget", "not a JSON integer"),
    ('{"trainguard": {"retry_budget": -1}}', "retry_budget", "below 0"),
    ('{"trainguard": {"min_world_size": 0}}', "min_world_size", "below 1"),
    ('{"trainguard": {"spares": null}}', "spares", "not a JSON integer"),
    ('{"trainguard": {"job": "a b"}}', "job", "cannot be a NATS subject token"),
    ('{"trainguard": {"mode": "action", "retries": 3}}', "retries", "unknown field"),
])
def test_an_invalid_directive_says_which_field_and_stays_observe(comment, field, words):
    with pytest.raises(DirectiveError) as exc:
        parse_directive(comment)
    assert exc.value.field == field and words in str(exc.value)
    assert '--comment=\'{"trainguard":{"mode":"observe"}}\'' in str(exc.value)  # what to write
    directive, error = directive_or_default(comment)
    assert directive == SlurmDirective(mode="observe") and error == str(exc.value)


def test_every_directive_field_is_a_record_setting_or_a_launch_flag():
    from trainguard.schemas.job import FIELDS

    launch_only = {"spares", "job"}
    assert set(DIRECTIVE_FIELDS) - launch_only <= set(FIELDS)
    assert set(DIRECTIVE_FIELDS) == set(launch_args.DIRECTIVE_FLAGS)
    for name in launch_only:
        assert launch_args.build_parser("").get_default(name) is None  # a flag of that name


# ---- the launcher: precedence flag > directive > environment > default ------------------------
@pytest.fixture
def slurm(monkeypatch):
    """Make the launch believe it runs in Slurm job 77 whose comment is what the test sets."""
    for k in ("TG_MODE", "TG_JOB", "SLURM_JOB_ID", "NATS_URL", "REDIS_URL"):
        monkeypatch.delenv(k, raising=False)
    box = {"comment": ""}
    real = launch_args.slurm_directive

    def fake(environ=None, run=None):
        return real(
            {"SLURM_JOB_ID": "77"},
            lambda argv, **kw: subprocess.CompletedProcess(argv, 0, box["comment"] + "\n", ""))

    monkeypatch.setattr(launch_args, "slurm_directive", fake)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    return box


def _launch(*flags):
    return launch_args.parse(["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2",
                              *flags, "t.py"])


D = json.dumps({"trainguard": {"mode": "action", "retry_budget": 3, "min_world_size": 2,
                               "spares": 1, "job": "llm"}})


@pytest.mark.parametrize("comment,env,flags,expected", [
    # (mode, job, retry budget, min world size, spares)
    ("", {}, [], ("observe", "slurm-77", 10, 1, 2)),
    (D, {}, [], ("action", "llm", 3, 2, 1)),
    (D, {"TG_MODE": "observe", "TG_JOB": "env-job"}, [], ("action", "llm", 3, 2, 1)),
    (D, {}, ["--mode", "observe", "--job", "flag-job", "--retry-budget", "5",
             "--min-world-size", "4", "--spares", "0"], ("observe", "flag-job", 5, 4, 0)),
    ('{"trainguard":{}}', {"TG_MODE": "action", "TG_JOB": "env-job"}, [],
     ("action", "env-job", 10, 1, 2)),
    # an invalid directive: observe, whatever TG_MODE says; a flag still wins
    ('{"trainguard":{"mode":"acton"}}', {"TG_MODE": "action"}, [],
     ("observe", "slurm-77", 10, 1, 2)),
    ('{"trainguard":{"mode":"acton"}}', {}, ["--mode", "action"],
     ("action", "slurm-77", 10, 1, 2)),
    ("just a note", {"TG_MODE": "action"}, [], ("action", "slurm-77", 10, 1, 2)),
])
def test_launch_precedence(slurm, monkeypatch, capsys, comment, env, flags, expected):
    slurm["comment"] = comment
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    c = _launch(*flags)
    assert (c.mode, c.job, c.retry_budget, c.min_world_size, c.spares) == expected
    err = capsys.readouterr().err
    assert ("acton" in err) == ("acton" in comment)  # an invalid directive is reported


def test_unreadable_comment_is_reported_and_the_launch_goes_on(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "77")

    def fails(argv, **kw):
        return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Unable to "
                                                          "contact slurm controller")
    d, note = launch_args.slurm_directive({"SLURM_JOB_ID": "77"}, fails)
    assert d is None and "Unable to contact slurm controller" in note

    def hangs(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw.get("timeout", 0))
    d, note = launch_args.slurm_directive({"SLURM_JOB_ID": "77"}, hangs)
    assert d is None and "cannot read the comment of Slurm job 77" in note
    assert launch_args.slurm_directive({}, fails) == (None, "")  # not under Slurm: no squeue
