"""Sharded and multi-node runs (``efficiency.sharding: fsdp``, ``resources.num_nodes``, issue 28) through
the run itself, under torchrun (gloo), on the accelerate backend. Each rank's bytes against the estimate,
for every mode and world size, are tests/trainer_core/memory/test_sharding_agreement.py's.

Runs of one global batch (micro-batch x processes) on different world sizes, 4 ranks x 4 rows and
2 x 8, see the same examples in each step (a plain shuffle, no length grouping, which groups by the
micro-batch) and no dropout, so they agree to float rounding: their gradient norms (over the whole
batch), evaluations and weights, not their logged losses (rank 0's own rows)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer_core import datagen
from tests.trainer_core.runhelpers import (
    assert_same_weights,
    cli_process,
    done_event,
    evaluate_saved,
    finish,
    run,
    text_spec,
    write_spec,
)
from tests.worker.live import free_port
from trainer_core.backends.common import build_training_model
from trainer_core.checkpoint import complete_checkpoints, read_progress
from trainer_core.init_from import init_source
from trainer_core.memory import estimate_memory
from trainer_core.modeling import MODEL_CLASSES
from trainer_core.sharding import SHARDED_DIR
from trainer_core.spec import JobSpec, SpecError

pytestmark = pytest.mark.usefixtures("warm_runs")  # the CLI runs fork from a zygote (tests/conftest.py)

NO_DROPOUT = {"config": {**datagen.TINY_BERT, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}


def spec_for(tmp_path: Path, sharding: str, processes: int, **sections: Any) -> JobSpec:
    # 64 rows / 16 a step: 4 steps an epoch, 8 in all; gradients clipped (max_grad_norm 1.0) every step
    training = {"num_train_epochs": 2, "per_device_train_batch_size": 16 // processes, "learning_rate": 3e-3,
                "logging_steps": 1, "save_steps": 2, "eval_strategy": "epoch"}  # fmt: skip
    return text_spec(
        tmp_path / "data", "accelerate", n_train=64, n_val=31, model=NO_DROPOUT, training=training,
        preprocessing={"group_by_length": False},
        efficiency={"sharding": sharding}, resources={"num_processes": processes}, **sections,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The baseline both tests compare with: DDP on one node of 2 processes, 8 rows each."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    status, events = run(spec_for(tmp_path, "none", 2), tmp_path / "out")
    assert status == "succeeded", done_event(events)
    return tmp_path / "out", events


def norms(events: Any) -> list[float]:
    """The gradient norm of every step: the whole batch's, whichever ranks computed it."""
    return [e["values"]["grad_norm"] for e in events.of_kind("metric")]


@pytest.mark.slow
def test_a_sharded_run_trains_as_ddp_does_and_resumes_from_its_shards_on_fewer_ranks(
    tmp_path: Path, ddp: tuple[Path, Any]
) -> None:
    ddp_dir, ddp_events = ddp
    spec = spec_for(tmp_path, "fsdp", 4)
    status, fsdp = run(spec, tmp_path / "fsdp")
    assert status == "succeeded", done_event(fsdp)

    # the same training: gradient norms at every step (clipped over the shards), evaluations, weights
    assert len(norms(fsdp)) == 8
    assert norms(fsdp) == pytest.approx(norms(ddp_events), rel=1e-4)
    final = done_event(fsdp)["summary"]["eval"]
    assert final["eval_loss"] == pytest.approx(done_event(ddp_events)["summary"]["eval"]["eval_loss"], rel=1e-5)
    assert_same_weights(ddp_dir, tmp_path / "fsdp")
    # the final model is gathered whole: it loads on its own and scores what the run reported
    assert evaluate_saved(spec, tmp_path / "fsdp")["eval_accuracy"] == pytest.approx(final["eval_accuracy"])

    # rank 0's memory event: its shards, as estimated (a quarter of the model and a little padding)
    (memory,) = fsdp.of_kind("memory")
    estimate = estimate_memory(spec, num_labels=2)
    for part in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert memory["values"][part] == getattr(estimate, part), part
    assert memory["values"]["parameter_bytes"] < ddp_events.of_kind("memory")[0]["values"]["parameter_bytes"] / 3

    # Checkpoints hold the shards. A run stopped after step 2, mid-epoch, resumes from them on 2 ranks
    # instead of 4 (the shards are re-split on load, its place in the epoch counted in this layout's
    # micro-batches) and ends as the whole run did, accumulating gradients over two micro-batches a step
    # where the whole run took one.
    out = tmp_path / "fsdp"
    assert [p.name for p in complete_checkpoints(out)] == [f"checkpoint-{step}" for step in (2, 4, 6, 8)]
    assert len(list((out / "checkpoint-2" / SHARDED_DIR).glob("*.distcp"))) == 4  # one file per rank
    # Another job starts from a sharded checkpoint (init_from.path): its weights read whole into an unsharded
    # model, here the last step's, which the final model saved whole holds too. Its optimizer state is not.
    started = spec_for(tmp_path, "none", 1, init_from={"path": str(out / "checkpoint-8")})
    built = build_training_model(started, ["negative", "positive"]).state_dict()
    final = MODEL_CLASSES[spec.task].from_pretrained(str(out)).state_dict()
    assert built.keys() == final.keys()
    for name, tensor in final.items():
        assert torch.equal(built[name], tensor), name
    with pytest.raises(SpecError) as refused:
        init_source(spec_for(tmp_path, "none", 1, init_from={"path": str(out / "checkpoint-8"),
                                                             "resume_optimizer": True}))
    assert [e.field for e in refused.value.errors] == ["init_from.resume_optimizer"]

    shutil.copytree(out, tmp_path / "reference")
    for step in (4, 6, 8):
        shutil.rmtree(out / f"checkpoint-{step}")
    (out / "metrics.json").unlink()
    # on 2 ranks of 4 rows with 2 accumulation steps: the same 16 rows a step, the optimizer stepping once
    fewer = spec_for(tmp_path, "fsdp", 2)
    fewer = fewer.model_copy(update={
        "training": fewer.training.model_copy(update={"per_device_train_batch_size": 4}),
        "efficiency": fewer.efficiency.model_copy(update={"gradient_accumulation_steps": 2}),
    })  # fmt: skip
    status, resumed = run(fewer, out, resume=True)
    assert status == "succeeded", done_event(resumed)
    assert norms(resumed) == pytest.approx(norms(fsdp)[2:], rel=1e-4)
    # another global batch would not line up with the checkpoint's steps: refused, naming the field
    bigger = fewer.model_copy(update={"training": fewer.training.model_copy(update={"per_device_train_batch_size": 8})})
    with pytest.raises(SpecError) as refused:
        read_progress(tmp_path / "reference" / "checkpoint-2", bigger)
    assert [e.field for e in refused.value.errors] == ["training.per_device_train_batch_size"]
    assert_same_weights(tmp_path / "reference", out)


@pytest.mark.slow
def test_two_nodes_of_one_process_train_as_one_node_of_two(tmp_path: Path, ddp: tuple[Path, Any]) -> None:
    """Two nodes on this machine, each ``trainjobs train`` with the same rendezvous (torchrun's c10d), run one
    sharded job of world size 2: the node the rendezvous made rank 0 reports it, the other only how its rank
    ended; rank 0 sees the rows it sees on one node of 2 processes, and the weights end the same."""
    ddp_dir, ddp_events = ddp
    single = spec_for(tmp_path, "fsdp", 2)
    two = single.model_copy(update={"resources": single.resources.model_copy(update={"num_processes": 1,
                                                                                      "num_nodes": 2})})
    assert two.world_size == 2
    spec_file = str(write_spec(two, tmp_path / "two-nodes.json"))
    rendezvous = ["--jsonl", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "two-nodes"]
    nodes = [cli_process(spec_file, "--output-dir", str(tmp_path / f"node{k}"), *rendezvous) for k in range(2)]
    events = [finish(node) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0]
    (lead,) = [k for k in range(2) if any(e["event"] == "metric" for e in events[k])]
    other = events[1 - lead]
    assert [e["event"] for e in other] == ["done"] and other[0]["status"] == "succeeded"
    assert events[lead][-1]["event"] == "done" and events[lead][-1]["status"] == "succeeded"
    lead_losses = [e["values"]["loss"] for e in events[lead] if e["event"] == "metric"]
    assert lead_losses == pytest.approx([e["values"]["loss"] for e in ddp_events.of_kind("metric")], rel=1e-5)
    assert_same_weights(ddp_dir, tmp_path / f"node{lead}")

    # Each node saves to its own disk, so a multi-node run's checkpoint is gathered whole on rank 0's:
    # the lead node alone holds complete checkpoints, and one resumes on one node of 2 processes.
    lead_dir, other_dir = tmp_path / f"node{lead}", tmp_path / f"node{1 - lead}"
    assert complete_checkpoints(other_dir) == []
    assert len(list((lead_dir / "checkpoint-2" / SHARDED_DIR).glob("*.distcp"))) == 1
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(lead_dir / "checkpoint-2", resumed_dir / "checkpoint-2")
    status, resumed = run(single, resumed_dir, resume=True)
    assert status == "succeeded", done_event(resumed)
    assert norms(resumed) == pytest.approx(norms(ddp_events)[2:], rel=1e-4)
    assert_same_weights(ddp_dir, resumed_dir)

    # without a rendezvous a multi-node spec is refused, naming the field
    with pytest.raises(SpecError) as refused:
        run(two, tmp_path / "alone")
    assert [e.field for e in refused.value.errors] == ["resources.num_nodes"]
