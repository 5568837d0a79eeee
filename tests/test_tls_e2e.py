"""A real 2-rank job over the TLS-only bus, launched with its own per-job worker user and the
rendezvous store's token (as ``trainguard up`` runs): the launcher and its ranks work within
that job's subjects and keys and reach the store through the launcher's relay, a SIGKILLed rank
is restarted by the services' decision, and the job finishes."""
import os
import signal
import time
import warnings

import pytest

from test_dropin_e2e import EPOCHS, FAULT_EPOCH, Run, _job, assert_resumed, decisions
from trainguard.rendezvous.gate import TOKEN_ENV
from trainguard.security.tls import CA_ENV

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory):
    from trainguard.stack.local import Stack

    logs = tmp_path_factory.mktemp("tls-stack-logs")
    st = Stack(services=("agent", "detector", "attributor", "remediator"),
               agent_nodes=("node0",), rendezvous=True, log_dir=str(logs),
               kernel_log_dir=str(logs), tls=True, rdzv_token=True)
    st.start(timeout=120)
    yield st
    st.stop()


def test_a_job_with_its_own_user_recovers_over_tls(tls_stack, tmp_path, monkeypatch):
    """Tried once more (a new job, its own user) when the first try fails, as
    tests/test_recovery_e2e.py's ``_tried``: the first failure is reported as a warning with
    the launcher's log, and two in a row fail the test (seen once in CI on a loaded machine: a
    rank started a second time after the recovery, the launcher's log not kept to say why)."""
    try:
        _trial(tls_stack, tmp_path / "try1", monkeypatch)
    except AssertionError as first:
        warnings.warn(f"the TLS job's first try failed, retrying: {str(first)[-12000:]}")
        _trial(tls_stack, tmp_path / "try2", monkeypatch)


def _trial(tls_stack, tmp_path, monkeypatch):
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = Run(tmp_path, _job("tls"))
    monkeypatch.setenv(CA_ENV, tls_stack.tls_ca)  # what the printed line exports
    # the rendezvous store admits only the token's holders: the launcher's relay has it, its
    # ranks (and torch's own store client in them) reach the store through that relay
    assert tls_stack.rdzv_token and f"{TOKEN_ENV}={tls_stack.rdzv_token}" in \
        tls_stack.env_exports("worker")
    monkeypatch.setenv(TOKEN_ENV, tls_stack.rdzv_token)
    nats_url, redis_url = tls_stack.issue_job(run.job)
    assert nats_url.startswith(f"tls://job-{run.job}:")
    try:
        node0 = run.launch(None, [
            "--nnodes", "1", "--nproc-per-node", "2", "--mode", "action", "--node", "node0",
            "--nats-url", nats_url, "--redis-url", redis_url,
            "--rdzv-endpoint", tls_stack.rdzv_endpoint, "--job", run.job,
            "--log-dir", str(tmp_path / "logs")], "node0")
        before = run.wait_epoch(2, FAULT_EPOCH, 150)
        t_fault = time.time_ns()
        os.kill(before[1]["pid"], signal.SIGKILL)
        assert node0.wait(150) == 0, run.tails()
        assert_resumed(run, 2, run.last_before(t_fault), t_fault, EPOCHS)
        ds = [d for d in decisions(tls_stack, run.job) if d["execute"]]
        assert ds and ds[0]["action"] == "restart_workers" and 1 in ds[0]["ranks"], ds
        # nothing the launcher or its ranks sent was outside the job's rights: the server logs
        # every refused publish or subscription with the user's name
        log = (tls_stack.data_dir / "nats" / "nats.log").read_text(errors="replace")
        refused = [line for line in log.splitlines()
                   if "Violation" in line and f'user:job-{run.job}"' in line]
        assert refused == [], refused
        assert "NOPERM" not in run.tails(20000) and "No permissions" not in run.tails(20000)
        # no rank was refused by the store's gate; a client without the token is
        rlog = (tls_stack.log_dir / "rendezvous.log").read_text(errors="replace")
        assert "refused a connection" not in rlog, rlog[-2000:]
        import datetime

        import torch.distributed as dist

        host, port = tls_stack.rdzv_endpoint.rsplit(":", 1)
        with pytest.raises(Exception):
            dist.TCPStore(host, int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=3)).get("anything")
    finally:
        run.close()
