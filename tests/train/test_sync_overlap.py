"""``sampler.weight_sync_overlap``: `PendingSync`, the one weight sync in flight on a background thread (driven
directly, no trainer), and the refusals where the overlap cannot apply (rules, the CLI's checks, the launch plan and
the Python API). The trainer's side runs in tests/train/test_sync_overlap_trainer.py."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from asyncgrpo_cli.config.rules import ConfigError, weight_sync_overlap_refusals
from asyncgrpo_cli.train.sync_overlap import PendingSync
from asyncgrpo_cli.train.weight_sync import WeightSyncError


def test_settle_returns_the_sync_metrics_and_ends_it():
    pending = PendingSync()
    assert not pending.in_flight and pending.settle() == ({}, 0.0)  # nothing in flight: nothing to wait for
    ran_on = []

    def sync():
        ran_on.append(threading.current_thread().name)
        return {"perf/weight_sync_s": 0.25}

    pending.start(3, sync)
    assert pending.in_flight and pending.version == 3
    metrics, waited = pending.settle()
    assert metrics == {"perf/weight_sync_s": 0.25} and waited >= 0.0
    assert ran_on == ["weight-sync-v3"]  # on its own thread, not the caller's
    assert not pending.in_flight and pending.version is None and not pending.done


def test_settle_re_raises_the_sync_error_and_ends_it():
    pending = PendingSync()
    error = WeightSyncError("weight sync to model version 2 failed at /update_weights: boom", "/update_weights", 2)

    def sync():
        raise error

    pending.start(2, sync)
    with pytest.raises(WeightSyncError) as raised:
        pending.settle()
    assert raised.value is error
    assert not pending.in_flight  # a failed sync is over too: the next one may start
    pending.start(3, lambda: {})
    assert pending.settle()[0] == {}


def test_settle_waits_for_a_slow_sync_and_times_the_wait():
    release = threading.Event()
    pending = PendingSync()

    def slow():
        release.wait(10)
        return {"perf/weight_sync_transfer_s": 0.2}

    pending.start(1, slow)
    time.sleep(0.05)
    assert pending.in_flight and not pending.done
    with pytest.raises(RuntimeError, match="version 1 is still in flight"):  # one at a time
        pending.start(2, slow)
    with pytest.raises(TimeoutError):
        pending.settle(timeout_s=0.05)
    assert pending.in_flight  # a settle that timed out leaves it in flight
    threading.Timer(0.3, release.set).start()
    metrics, waited = pending.settle()
    assert metrics == {"perf/weight_sync_transfer_s": 0.2}
    assert 0.2 <= waited < 5.0  # the seconds the caller blocked


def test_the_thread_selects_the_trainer_cuda_device_and_a_stream_after_the_callers_and_nothing_on_cpu(monkeypatch):
    """On CUDA (faked here: the calls are recorded): the caller's stream gets an event at `start`; the thread selects
    the trainer's device (the current device is per thread), waits on its own stream for that event, runs the sync
    on that stream and synchronizes it before the sync counts as done. On a CPU trainer: no CUDA call at all."""
    calls = []

    class Event:
        def record(self, stream):
            calls.append(("record", stream, threading.current_thread().name))

    class Stream:
        def __init__(self, device):
            calls.append(("new stream", device))

        def wait_event(self, event):
            calls.append(("wait", type(event).__name__))

        def synchronize(self):
            calls.append(("synchronize",))

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            calls.append(("enter stream",))

        def __exit__(self, *exc):
            calls.append(("exit stream",))

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"current stream of {device}")
    for device in (None, "cpu", torch.device("cpu")):
        pending = PendingSync(device)
        pending.start(1, lambda: {})
        pending.settle()
    assert calls == []  # no CUDA call on a CPU trainer
    pending = PendingSync("cuda:1")
    for version in (1, 2):
        pending.start(version, lambda: calls.append(("sync",)) or {"ok": 1.0})
        assert pending.settle()[0] == {"ok": 1.0}
    cuda1 = torch.device("cuda", 1)
    one = [("record", f"current stream of {cuda1}", "MainThread"), ("set_device", cuda1), ("wait", "Event"),
           ("enter stream",), ("sync",), ("exit stream",), ("synchronize",)]
    assert calls == one[:2] + [("new stream", cuda1)] + one[2:] + one, calls  # the stream is made once
    # "cuda" without an index (accelerate's device for one process; the first GPU run raised in set_device): the
    # caller's current device, read on the caller's thread
    calls.clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    pending = PendingSync(torch.device("cuda"))
    pending.start(1, lambda: {})
    pending.settle()
    assert ("set_device", torch.device("cuda", 3)) in calls and pending.device == torch.device("cuda", 3), calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_cuda_gpu_the_sync_reads_what_the_callers_stream_wrote_before_start_on_its_own_stream():
    x = torch.zeros(4096, 4096, device="cuda")
    pending = PendingSync(torch.device("cuda"))  # no index, as accelerate gives one process
    slow = torch.randn(8192, 8192, device="cuda")
    for round_ in range(3):
        for _ in range(10):  # keeps the caller's stream busy: the writes below are still queued at start()
            slow = slow @ slow
            slow = slow / slow.norm()
        for _ in range(50):
            x.add_(1.0)
        seen = {}

        def sync():
            seen["stream"] = torch.cuda.current_stream()
            seen["value"] = float(x[0, 0] + x[-1, -1])  # on the sync's stream: after the caller's writes only
            return {}

        pending.start(round_ + 1, sync)
        busy = torch.randn(8192, 8192, device="cuda")
        for _ in range(20):  # the next step's work, launched meanwhile on the caller's stream
            busy = busy @ busy
            busy = busy / busy.norm()
        pending.settle()
        assert seen["value"] == 2 * 50.0 * (round_ + 1), seen
        assert seen["stream"] != torch.cuda.default_stream()
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ refusals
def test_the_rules_name_the_field_the_value_and_the_fix():
    cli = lambda n: f"sampler.{n}"  # noqa: E731
    assert weight_sync_overlap_refusals(check_weight_sync=False, lora=False, processes=1, key=cli,
                                        lora_key="peft.enabled=true") == []
    [many] = weight_sync_overlap_refusals(check_weight_sync=False, lora=False, processes=4, key=cli, lora_key="",
                                          one_process="launch.trainer_gpus=[1]")
    assert str(many).startswith("sampler.weight_sync_overlap=true with 4 trainer processes: FSDP")
    assert str(many).endswith("Fix: sampler.weight_sync_overlap=false, or launch.trainer_gpus=[1]")
    [check] = weight_sync_overlap_refusals(check_weight_sync=True, lora=False, processes=None, key=cli, lora_key="")
    assert str(check).startswith("sampler.weight_sync_overlap=true with sampler.check_weight_sync=true: ")
    assert "Fix: sampler.weight_sync_overlap=false, or sampler.check_weight_sync=false" in str(check)
    [lora] = weight_sync_overlap_refusals(check_weight_sync=False, lora=True, processes=None, key=cli,
                                          lora_key="peft.enabled=true")
    assert str(lora).startswith("sampler.weight_sync_overlap=true with peft.enabled=true: ") and "Fix:" in str(lora)
    api = weight_sync_overlap_refusals(check_weight_sync=True, lora=True, processes=2, key=str, lora_key="peft_config")
    assert [str(e).split(":")[0] for e in api] == ["weight_sync_overlap=True with 2 trainer processes",
                                                   "weight_sync_overlap=True with check_weight_sync=True",
                                                   "weight_sync_overlap=True with peft_config"]
    assert all("Fix: weight_sync_overlap=False" in str(e) for e in api)


def test_the_cli_checks_refuse_it_with_check_weight_sync_or_lora_and_warn_on_policy():
    from asyncgrpo_cli.config.compose import compose, to_training_args
    from asyncgrpo_cli.config.run_checks import validate_run

    cfg = compose(["+recipe=smoke", "sampler.weight_sync_overlap=true"])
    assert cfg.sampler.weight_sync_overlap is True and to_training_args(cfg).weight_sync_overlap is True
    assert compose(["+recipe=smoke"]).sampler.weight_sync_overlap is False  # opt-in
    assert not any("weight_sync_overlap" in w for w in validate_run(cfg, "train"))  # the embedded sampler: it works
    with pytest.raises(ConfigError, match=r"^sampler\.weight_sync_overlap=true with sampler\.check_weight_sync=true: "
                                          r".*Fix: sampler\.weight_sync_overlap=false"):
        validate_run(compose(["+recipe=smoke", "sampler.weight_sync_overlap=true", "sampler.check_weight_sync=true"]),
                     "train")
    with pytest.raises(ConfigError, match=r"^sampler\.weight_sync_overlap=true with peft\.enabled=true: .*Fix: "):
        validate_run(compose(["+recipe=smoke", "sampler.weight_sync_overlap=true", "peft.enabled=true"]), "train")
    warned = validate_run(compose(["+recipe=smoke", "sampler.weight_sync_overlap=true", "staleness.max_staleness=0"]),
                          "train")
    assert any(w.startswith("sampler.weight_sync_overlap=true overlaps nothing at staleness.max_staleness=0")
               for w in warned), warned


def test_the_launch_plan_refuses_it_with_several_trainer_processes():
    from asyncgrpo_cli.config.compose import compose
    from asyncgrpo_cli.launch.plan import build_launch_plan

    def problems(*overrides, gpus=0):
        cfg = compose(["+recipe=smoke", *overrides])
        return [p for p in build_launch_plan(cfg, gpus).problems if "weight_sync_overlap" in p]

    assert problems("sampler.weight_sync_overlap=true") == []  # one CPU process
    assert problems("launch.cpu_processes=2") == []  # off: FSDP as before
    [cpu] = problems("sampler.weight_sync_overlap=true", "launch.cpu_processes=2")
    assert cpu.startswith("sampler.weight_sync_overlap=true with 2 trainer processes: ")
    assert cpu.endswith("Fix: sampler.weight_sync_overlap=false, or launch.cpu_processes=1")
    [gpu] = problems("sampler.weight_sync_overlap=true", "sampler.backend=vllm", "sampler.device=auto", gpus=3)
    assert gpu.startswith("sampler.weight_sync_overlap=true with 2 trainer processes: ") and \
        gpu.endswith("or launch.trainer_gpus=[1]"), gpu


@pytest.mark.parametrize("case", ["processes", "check_weight_sync", "peft_config"])
def test_the_python_api_refuses_it_before_loading_anything(case, monkeypatch, tmp_path):
    import datasets

    from asyncgrpo_cli import AsyncGRPOConfig, AsyncGRPOTrainer

    if case == "processes":
        monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun / accelerate launch set it
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, report_to="none",
                           weight_sync_overlap=True, check_weight_sync=case == "check_weight_sync")
    peft_config = None
    if case == "peft_config":
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}]}])
    expected = {"processes": "weight_sync_overlap=True with 2 trainer processes",
                "check_weight_sync": "weight_sync_overlap=True with check_weight_sync=True",
                "peft_config": "weight_sync_overlap=True with a LoRA model (peft_config)"}[case]
    with pytest.raises(ConfigError, match=rf"^{re.escape(expected)}: .*Fix: weight_sync_overlap=False"):
        AsyncGRPOTrainer(model="no/such-model-is-loaded", reward_funcs=[lambda completions, **kw: [0.0]],
                         args=args, train_dataset=data, peft_config=peft_config)
