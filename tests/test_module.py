"""hap.HAP end to end on real gloo ranks: a built-in model (ViT, dropout off so that one
device's random numbers need not be reproduced) planned for the local cluster (one rank 3x
slower, so the ratios are uneven) trains like one device; bad set-ups fail with one clear
error on every rank. SGD, not Adam: Adam turns the rounding noise of gradients that are
exactly zero in theory (attention's key bias) into full-size steps."""

import dataclasses

import pytest
import torch
from gloo import run_ranks

import hap
from hap.models import vit

STEPS = 2


def small_vit():
    torch.manual_seed(0)
    cfg = dataclasses.replace(vit.ViTConfig.small(), dropout=0.0)
    model = vit.ViT(cfg).train()
    gen = torch.Generator().manual_seed(0)
    batches = [vit.example_inputs(cfg, 12, gen) for _ in range(STEPS)]
    return model, batches


def train(model, batches):
    """SGD with momentum over the batches; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in batches:
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_hap(rank, world):
    model, batches = small_vit()
    dmodel = hap.HAP(model, hap.load_cluster("local"), batches[0])
    losses = train(dmodel, batches)
    params = {k: v.tolist() for k, v in dmodel.full_parameters().items()}
    return {"losses": losses, "params": params, "ratios": dmodel.plan.ratios}


def test_hap_trains_vit_like_one_device(tmp_path):
    reports = run_ranks(train_hap, 2, tmp_path)
    model, batches = small_vit()
    losses = train(model, batches)
    for got in reports:
        assert got["ratios"][0][0] > got["ratios"][0][1]  # the 3x slower rank gets less work
        assert got["losses"] == pytest.approx(losses, rel=1e-5)
        for name, p in model.named_parameters():
            assert torch.allclose(torch.tensor(got["params"][name]), p.detach(), rtol=1e-4, atol=1e-5), name


def wrong_world(rank, world):
    model, batches = small_vit()
    try:
        hap.HAP(model, hap.load_cluster("local-4"), batches[0])
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def test_wrong_rank_count_is_a_clear_error(tmp_path):
    for got in run_ranks(wrong_world, 2, tmp_path):
        assert got["error"] == "cluster 'local-4' has 4 devices but 2 ranks are running"


def test_cli_train_runs_a_baseline(capsys):
    from hap.cli import main

    assert main(["train", "--model", "vit", "--steps", "2", "--strategy", "dp-cp"]) == 0
    out = capsys.readouterr().out
    assert "per-iteration time: measured" in out and "estimated" in out
