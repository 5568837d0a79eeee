"""Subject tokens of names with dots (Kubernetes node names such as EKS's
``ip-10-0-1-2.ec2.internal``): they round-trip through ``token``/``parse``, every name that was a
token before is still its own token, and what can never be a name is refused."""
import pytest

from trainguard.schemas import subjects

OLD = ["node0", "gpu-node-3", "job_1", "ns:job", "a-b_c:d-9", "0"]
DOTTED = ["ip-10-0-1-2.ec2.internal", "gke-pool-1-abc.us-central1-a.c.proj.internal",
          "node.1", "a.b.c.d"]


@pytest.mark.parametrize("name", OLD)
def test_names_that_were_tokens_are_unchanged(name):
    assert subjects.token(name) == name
    assert subjects.node(name, "heartbeat") == f"tg.node.{name}.heartbeat"
    assert subjects.parse(subjects.job(name, "decision"))["name"] == name


@pytest.mark.parametrize("name", DOTTED)
def test_a_dotted_name_round_trips(name):
    tok = subjects.token(name)
    assert "." not in tok and subjects.untoken(tok) == name
    for subject in (subjects.node(name, "heartbeat"), subjects.job(name, "control")):
        parts = subject.split(".")
        assert len(parts) == 4, subject  # still one token: wildcards such as tg.node.*.x match
        assert subjects.parse(subject)["name"] == name
    hb = subjects.parse(subjects.rank_hb(name, 7))
    assert hb == {"scope": "job", "name": name, "kind": "hb", "rank": "7"}


@pytest.mark.parametrize("node, job", [("node0", "job_1"), ("ip-10-0-1-2.ec2.internal",
                                                              "train.7")])
def test_a_launchers_subject_is_under_its_node_and_names_its_job(node, job):
    subject = subjects.launcher(node, job)
    assert subject == f"tg.node.{subjects.token(node)}.launcher.{subjects.token(job)}"
    assert len(subject.split(".")) == 5  # tg.node.*.launcher.<job> matches one job's
    assert subjects.parse(subject) == {"scope": "node", "name": node, "kind": "launcher",
                                       "job": job}
    assert "job" not in subjects.parse(subjects.node(node, "heartbeat"))
    with pytest.raises(ValueError):
        subjects.launcher(node, "a*")


def test_distinct_names_get_distinct_tokens():
    names = OLD + DOTTED + ["a2Eb", "a-2E-b"]
    assert len({subjects.token(n) for n in names}) == len(names)


@pytest.mark.parametrize("bad", ["", "a*b", "a>b", "a b", "a\tb", "a%2Eb", ".a", "a.", "a..b",
                                 "x/y"])
def test_what_can_never_be_a_name_is_refused(bad):
    with pytest.raises(ValueError, match="cannot be a NATS subject token"):
        subjects.token(bad)


def test_health_subject_of_an_agent_on_a_dotted_node_is_one_token():
    from trainguard.services.base import health_subject

    assert health_subject("agent-ip-10-0-1-2.ec2.internal") == \
        "tg.svc.agent-ip-10-0-1-2%2Eec2%2Einternal.health"
