"""The typed job record (``schemas.job``): one encoding per field, round trip and defaults, no
server."""
from __future__ import annotations

import dataclasses

import pytest

from trainguard.schemas.job import (
    FIELDS,
    PARTS,
    JobRecord,
    JobRecordError,
    JobSettings,
    decode_record,
    encode_fields,
    encode_value,
)

MEMBERS = [{"rank": 0, "node": "n0", "local_rank": 0}, {"rank": 1, "node": "n1", "local_rank": 0}]


# field, a value, its hash text
@pytest.mark.parametrize("name,value,text", [
    ("mode", "action", "action"),
    ("world_size", 4, "4"),
    ("min_world_size", 2, "2"),
    ("retry_budget", 5, "5"),
    ("nnodes", 2, "2"),
    ("nproc_per_node", 2, "2"),
    ("hang_timeout_s", 30.0, "30.0"),
    ("startup_timeout_s", 120.5, "120.5"),
    ("node_timeout_s", 3.0, "3.0"),
    ("slurm_job_id", "4242", "4242"),
    ("generation", 7, "7"),
    ("generation_by", "4f2a9c0e", "4f2a9c0e"),
    ("status", "stopped", "stopped"),
    ("runs", 2, "2"),
    ("members", MEMBERS, '[{"local_rank": 0, "node": "n0", "rank": 0}, '
                         '{"local_rank": 0, "node": "n1", "rank": 1}]'),
    ("spare_nodes", ["s1", "s2"], '["s1", "s2"]'),
    ("group_attempt", "3:2", "3:2"),
    ("generation_ends", {"6": "1796296051930000000"}, '{"6": "1796296051930000000"}'),
    ("run_id", "17.1", "17.1"),
    ("retries_used", 1, "1"),
    ("last_fault", {"fault_class": "crash", "step": 12}, '{"fault_class": "crash", "step": 12}'),
    ("last_decision", {"id": "d1", "action": "restart_workers"},
     '{"action": "restart_workers", "id": "d1"}'),
    ("pending_decision", {"event_id": "e1", "deadline_ns": 5}, '{"deadline_ns": 5, '
                                                                '"event_id": "e1"}'),
    ("slurm_state", "RUNNING", "RUNNING"),
    ("slurm_nodes", ["node0", "node1"], '["node0", "node1"]'),
    ("slurm_partition", "gpu", "gpu"),
    ("slurm_restarts", 1, "1"),
    ("slurm_directive", {"mode": "action", "retry_budget": 3},
     '{"mode": "action", "retry_budget": 3}'),
    ("slurm_directive_error", "field 'mode': …", "field 'mode': …"),
])
def test_every_field_round_trips_in_its_one_encoding(name, value, text):
    assert encode_value(name, value) == text
    assert getattr(decode_record({name: text}), name) == value


def test_the_table_above_names_every_field():
    names = {p[0] for p in test_every_field_round_trips_in_its_one_encoding.pytestmark[0].args[1]}
    assert names == set(FIELDS)


def test_every_field_has_a_part_a_codec_and_a_meaning():
    assert [n for p in PARTS.values() for n in p] == list(FIELDS)
    for f in FIELDS.values():
        assert f.metadata["codec"].name in ("int", "float", "str", "json")
        assert f.metadata["doc"], f.name
    assert set(PARTS["settings"]) == {f.name for f in dataclasses.fields(JobSettings)}


def test_defaults_of_an_unknown_job():
    rec = decode_record({})
    assert rec == JobRecord()
    assert (rec.mode, rec.world_size, rec.retry_budget, rec.hang_timeout_s) == ("", 0, None, 0.0)
    assert (rec.generation, rec.status, rec.members, rec.spare_nodes) == (0, "", [], [])
    assert rec.pending_decision is None and rec.last_fault is None


def test_whole_record_round_trip():
    rec = JobRecord(mode="action", world_size=2, retry_budget=3, hang_timeout_s=9.5,
                    generation=4, status="running", runs=1, members=MEMBERS,
                    spare_nodes=["s1"], retries_used=2, last_fault={"step": None},
                    pending_decision={"event_id": "e"})
    put, drop = encode_fields(**rec.to_dict())
    assert set(drop) == {"last_decision", "slurm_directive", "generation_ends"}  # None: absent
    assert decode_record(put) == rec
    assert rec.settings() == JobSettings(mode="action", world_size=2, retry_budget=3,
                                         hang_timeout_s=9.5)


def test_empty_and_unknown_values():
    # an empty non-str value is absent (older writers cleared pending_decision with "")
    assert decode_record({"pending_decision": "", "generation": ""}) == JobRecord()
    assert decode_record({"a_newer_field": "x"}) == JobRecord()


@pytest.mark.parametrize("raw", [
    {"generation": "five"},
    {"hang_timeout_s": "soon"},
    {"members": "not json"},
    {"members": '{"rank": 0}'},
    {"members": '[{"node": "n0"}]'},
    {"spare_nodes": '[{"node": "s9"}]'},
    {"last_fault": '"crash"'},
    {"slurm_nodes": '"node0"'},
    {"slurm_directive": '["action"]'},
])
def test_a_value_its_codec_cannot_read_raises(raw):
    with pytest.raises(JobRecordError) as exc:
        decode_record(raw)
    assert exc.value.field == next(iter(raw)) and "HDEL" in str(exc.value)


def test_encoding_an_unknown_field_raises():
    with pytest.raises(KeyError):
        encode_fields(hang_timeout=3)


def test_the_protocol_doc_lists_every_field():
    import os
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "protocol.md")).read()
    section = doc[doc.index("## Job registration"):doc.index("## Signals")]
    assert [n for n in FIELDS if f"| `{n}` |" not in section] == []
