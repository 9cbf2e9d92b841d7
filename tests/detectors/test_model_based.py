"""Detectors that need the model: odin and mcd (run it again on the inputs) and gradnorm (closed form).

Each is compared with pytorch-ood 0.4 on a tiny real CNN and random inputs, and with a float64
reference written here; the input stream of the engine (OOM back-off, cancel, order) and a run
with odin in its detector list are tested end to end. The model-based detectors that read a feature map (adascale,
rankfeat, gram), mahalanobis_odin and mds_ensemble (each in its own file) in a run, on a model they must leave as it
was, and on the GPU.
"""

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from detector_checks import spearman
from helpers import cuda
from kernels import assert_kernel_close
from pytorch_ood.detector import MCD as PoodMCD
from pytorch_ood.detector import ODIN as PoodODIN
from pytorch_ood.detector import GradNorm as PoodGradNorm
from tiny_cnn import TinyCNN, backbone_of, inputs
from torch import nn
from wide_cnn import WideCNN, labelled_images, wide_backbone_of

from oodviz import Batch
from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
from oodviz.detectors import create, detector_class
from oodviz.engine import Cancelled, score_inputs
from oodviz.models import wrap_model


def modes(model):
    return [m.training for m in model.modules()]


# ---- odin ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [{}, {"temperature": 1.0, "epsilon": 0.01}, {"temperature": 10.0, "epsilon": 0.005, "norm_std": [0.2, 0.5, 1.5]}],
)
def test_odin_matches_pytorch_ood(params):
    model, x = TinyCNN(), inputs()
    ours = create("odin", model=model, **params).score(Batch(inputs=x))
    reference = PoodODIN(
        model,
        temperature=params.get("temperature", 1000.0),
        eps=params.get("epsilon", 0.0014),
        norm_std=params.get("norm_std"),
    ).predict(x)
    assert spearman(ours, reference) > 0.9999
    torch.testing.assert_close(ours, reference.float(), rtol=1e-5, atol=1e-6)


def test_odin_equals_a_float64_reference_on_a_linear_model():
    """For logits W x + b the input gradient of -log S_y(x; T) is -(W_y - sum_k S_k W_k) / T."""
    g = torch.Generator().manual_seed(3)
    weight, bias = (
        torch.randn(5, 3 * 8 * 8, generator=g, dtype=torch.float64) * 0.3,
        torch.randn(5, generator=g, dtype=torch.float64),
    )
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 5))
    with torch.no_grad():
        model[1].weight.copy_(weight)
        model[1].bias.copy_(bias)
    x = inputs().double()
    for temperature, epsilon, std in [(1000.0, 0.0014, None), (2.0, 0.05, [0.5, 1.0, 2.0])]:
        flat = x.flatten(1)
        s = torch.softmax((flat @ weight.T + bias) / temperature, dim=1)
        y = s.argmax(dim=1)
        gradient = -(weight[y] - s @ weight) / temperature
        step = gradient.sign().view_as(x)
        if std is not None:
            step = step / torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
        perturbed = (x - epsilon * step).flatten(1)
        expected = -torch.softmax((perturbed @ weight.T + bias) / temperature, dim=1).amax(dim=1)
        ours = create("odin", model=model, temperature=temperature, epsilon=epsilon, norm_std=std).score(
            Batch(inputs=x.float())
        )
        torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6)
        assert spearman(ours, expected) > 0.9999


@pytest.mark.kernels
def test_odin_batch_equals_per_sample_and_any_model_form():
    model, x = TinyCNN(), inputs()
    det = create("odin", model=model, temperature=1.0, epsilon=0.01)
    whole = det.score(Batch(inputs=x))
    one_by_one = torch.cat([det.score(Batch(inputs=x[i : i + 1])) for i in range(len(x))])
    assert_kernel_close(one_by_one, whole)  # other batch shapes: other kernels
    uneven = det.score([Batch(inputs=x[:7]), Batch(inputs=x[7:30]), Batch(inputs=x[30:])])
    assert_kernel_close(uneven, whole)
    # A Backbone, a plain function returning logits and one returning (features, logits) agree.
    for other in (backbone_of(model), lambda t: model(t), lambda t: (t.flatten(1), model(t))):
        torch.testing.assert_close(
            create("odin", model=other, temperature=1.0, epsilon=0.01).score(Batch(inputs=x)), whole
        )
    # epsilon = 0 is temperature-scaled MSP; the perturbation changes the scores.
    msp = -torch.softmax(model(x) / 1.0, dim=1).amax(dim=1)
    torch.testing.assert_close(
        create("odin", model=model, temperature=1.0, epsilon=0).score(Batch(inputs=x)), msp.detach()
    )
    assert not torch.allclose(whole, msp)


def test_odin_norm_std_auto_reads_the_backbone_transform():
    from torchvision import transforms

    model, x = TinyCNN(), inputs()
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5, 0.5, 0.5], [0.2, 0.5, 1.5])])
    bb = wrap_model(model, normalize, head="fc", input_shape=(3, 8, 8))
    det = create("odin", model=bb, temperature=1.0, epsilon=0.01)
    assert det.channel_std() == pytest.approx([0.2, 0.5, 1.5])
    explicit = create("odin", model=model, temperature=1.0, epsilon=0.01, norm_std=[0.2, 0.5, 1.5]).score(
        Batch(inputs=x)
    )
    torch.testing.assert_close(det.score(Batch(inputs=x)), explicit)
    assert create("odin", model=model).channel_std() is None  # a bare module: steps in input units
    assert create("odin", model=backbone_of(model)).channel_std() is None
    with pytest.raises(ValueError, match="norm_std has 2 values but the inputs have 3 channels"):
        create("odin", model=model, norm_std=[0.2, 0.3]).score(Batch(inputs=x))
    with pytest.raises(ValueError, match="norm_std must be 'auto', None"):
        create("odin", norm_std=[0.2, -1])


def test_odin_leaves_the_model_as_it_was():
    model, x = TinyCNN(), inputs()
    model.train()  # batch norm in training mode would normalise by the batch and update its statistics
    model.conv1.eval()  # a mixed state must come back exactly
    before = modes(model)
    running_mean = model.bn.running_mean.clone()
    frozen = model.conv2.weight
    frozen.requires_grad_(False)
    scores = create("odin", model=model).score(Batch(inputs=x))
    assert modes(model) == before
    assert not frozen.requires_grad and model.conv1.weight.requires_grad
    assert all(p.grad is None for p in model.parameters()) and torch.equal(model.bn.running_mean, running_mean)
    # eval mode while scoring: pytorch-ood's ODIN (the same defaults) on a copy of the model in eval mode
    reference = PoodODIN(copy.deepcopy(model).eval(), temperature=1000.0, eps=0.0014).predict(x)
    torch.testing.assert_close(scores, reference.float(), rtol=1e-5, atol=1e-6)
    # after an error too (a wrong input shape fails inside the model)
    with pytest.raises(RuntimeError):
        create("odin", model=model).score(Batch(inputs=torch.randn(4, 2, 8, 8)))
    assert modes(model) == before and model.conv1.weight.requires_grad and not frozen.requires_grad


def test_odin_works_inside_inference_mode():
    """Input gradients need autograd, which inference mode turns off (and its tensors refuse)."""
    model, x = TinyCNN(), inputs()
    expected = PoodODIN(model, temperature=1000.0, eps=0.0014).predict(x).float()  # outside inference mode
    with torch.inference_mode():
        x_inference = x.clone()
        scores = create("odin", model=model).score(Batch(inputs=x_inference))
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)


def test_model_detectors_say_what_is_missing():
    x = inputs()
    for name in ("odin", "mcd"):
        cls = detector_class(name)
        assert cls.needs_model and not cls.needs_fit and cls.inputs == ("inputs",)
        with pytest.raises(ValueError, match=rf"create\('{name}', model=\.\.\.\)"):
            create(name).score(Batch(inputs=x))
        with pytest.raises(ValueError, match=rf"create\('{name}', model=\.\.\.\)"):
            create(name).fit(None)
    det = create("odin", model=TinyCNN())
    assert det.fit([Batch(features=torch.ones(3, 4))], head=None, device="cpu") is det  # the usual arguments
    with pytest.raises(ValueError, match=r"odin needs inputs but batch 0 has none"):
        det.score(Batch(features=torch.ones(3, 16)))
    bad = x.clone()
    bad[3, 1, 2, 2] = float("nan")
    with pytest.raises(ValueError, match="1 sample\\(s\\) with NaN or infinite inputs"):
        det.score(Batch(inputs=bad))
    with pytest.raises(ValueError, match="empty"):
        det.score([])
    with pytest.raises(ValueError, match="must return logits"):
        create("odin", model=lambda t: t.sum()).score(Batch(inputs=x))
    with pytest.raises(ValueError, match="model must be an oodviz Backbone"):
        create("odin", model="resnet18")
    with pytest.raises(ValueError, match="must satisfy|must be > 0"):
        create("odin", temperature=0)
    with pytest.raises(ValueError, match="epsilon is a step size"):
        create("odin", epsilon=-1)
    with pytest.raises(ValueError, match="Batch.inputs must be a floating-point"):
        Batch(inputs=torch.zeros(3, 4, dtype=torch.long))


# ---- gradnorm --------------------------------------------------------------------------------


def features_and_logits(model, x):
    bb = backbone_of(model)
    features, logits = bb.features_and_logits(x)
    return features, logits, bb.head


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_gradnorm_closed_form_equals_per_sample_autograd_in_float64(temperature):
    model, x = TinyCNN(), inputs()
    features, logits, head = features_and_logits(model, x)
    det = create("gradnorm", temperature=temperature).fit(
        [Batch(features, logits, torch.zeros(len(x), dtype=torch.long))], head=head
    )
    scores = det.score(Batch(features, logits))
    weight = head[0].double().clone().requires_grad_(True)
    bias = head[1].double()
    expected = []
    for f in features.double():  # the definition, one sample at a time
        z = (weight @ f + bias) / temperature
        loss = -torch.log_softmax(z, dim=0).mean()  # cross-entropy to uniform = KL + log C
        (grad,) = torch.autograd.grad(loss, weight)
        expected.append(-grad.abs().sum())
    torch.testing.assert_close(scores.double(), torch.stack(expected), rtol=1e-5, atol=1e-7)
    # one row at a time gives the same numbers
    single = torch.cat([det.score(Batch(features[i : i + 1], logits[i : i + 1])) for i in range(len(x))])
    torch.testing.assert_close(single, scores)


def test_gradnorm_matches_pytorch_ood():
    model, x = TinyCNN(), inputs()
    features, logits, head = features_and_logits(model, x)
    det = create("gradnorm").fit([Batch(features, logits, torch.zeros(len(x), dtype=torch.long))], head=head)
    reference = PoodGradNorm(model, param_filter=lambda name: name == "fc.weight").predict(x)
    ours = det.score(Batch(features, logits))
    assert spearman(ours, reference) > 0.9999
    torch.testing.assert_close(ours, reference.float(), rtol=1e-4, atol=1e-6)


def test_gradnorm_needs_the_head_of_the_features():
    model, x = TinyCNN(), inputs()
    features, logits, head = features_and_logits(model, x)
    labels = torch.zeros(len(x), dtype=torch.long)
    with pytest.raises(ValueError, match="needs the classifier's final linear layer"):
        create("gradnorm").fit([Batch(features, logits, labels)])
    with pytest.raises(ValueError, match="the head does not map the features to the logits"):
        create("gradnorm").fit([Batch(features, logits, labels)], head=(head[0] * 3, head[1]))
    assert not detector_class("gradnorm").needs_model


# ---- mcd -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["mean", "var"])
def test_mcd_matches_pytorch_ood_with_the_same_seed(mode):
    model, x = TinyCNN(dropout=0.3), inputs()
    ours = create("mcd", model=model, samples=30, mode=mode, seed=7).score(Batch(inputs=x))
    torch.manual_seed(7)
    reference = PoodMCD(model, samples=30, mode=mode).predict(x)
    assert spearman(ours, reference) > 0.9999
    torch.testing.assert_close(ours, reference.float(), rtol=1e-5, atol=1e-7)


def test_mcd_equals_a_float64_reference():
    model, x = TinyCNN(dropout=0.5), inputs()
    samples = 25
    torch.manual_seed(11)
    model.drop.train()
    probs = torch.stack([torch.softmax(model(x).double(), dim=1) for _ in range(samples)]).detach()  # [N, B, C]
    model.drop.eval()
    mean_expected = -probs.mean(dim=0).amax(dim=1)
    var_expected = probs.var(dim=0, unbiased=True).mean(dim=1)
    mean = create("mcd", model=model, samples=samples, seed=11).score(Batch(inputs=x))
    var = create("mcd", model=model, samples=samples, mode="var", seed=11).score(Batch(inputs=x))
    torch.testing.assert_close(mean.double(), mean_expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(var.double(), var_expected, rtol=1e-4, atol=1e-8)
    assert not torch.allclose(mean.double(), -torch.softmax(model(x).double(), dim=1).amax(dim=1))  # dropout was on


def test_mcd_seed_is_reproducible_and_leaves_the_global_random_state_alone():
    model, x = TinyCNN(dropout=0.3), inputs()
    state = torch.get_rng_state()
    a = create("mcd", model=model, seed=3).score(Batch(inputs=x))
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(create("mcd", model=model, seed=3).score(Batch(inputs=x)), a)
    assert not torch.equal(create("mcd", model=model, seed=4).score(Batch(inputs=x)), a)
    create("mcd", model=model, seed=None).score(Batch(inputs=x))
    assert not torch.equal(torch.get_rng_state(), state)  # seed=None draws from the global state


def test_mcd_batch_and_per_sample_agree_in_expectation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 5)).eval()
    x = inputs(n=8)
    det = create("mcd", model=model, samples=800, seed=0)
    whole = det.score(Batch(inputs=x))
    one_by_one = det.score([Batch(inputs=x[i : i + 1]) for i in range(len(x))])
    # the masks differ between the two; the mean softmax of 800 passes does not (much)
    torch.testing.assert_close(whole, one_by_one, rtol=0, atol=0.03)
    assert not torch.allclose(whole, -torch.softmax(model(x), dim=1).amax(dim=1).detach(), atol=1e-4)


def test_mcd_restores_the_model_and_rejects_a_model_without_dropout():
    model, x = TinyCNN(dropout=0.3), inputs()
    model.train()
    model.bn.eval()
    before = modes(model)
    create("mcd", model=model, samples=3).score(Batch(inputs=x))
    assert modes(model) == before
    with pytest.raises(RuntimeError):
        create("mcd", model=model, samples=3).score(Batch(inputs=torch.randn(4, 2, 8, 8)))
    assert modes(model) == before
    model.eval()
    create("mcd", model=model, samples=3).score(Batch(inputs=x))
    assert not any(modes(model))  # dropout was switched on for the passes only
    for plain in (TinyCNN(), nn.Sequential(nn.Flatten(), nn.Dropout(0.0), nn.Linear(192, 5)), lambda t: t.flatten(1)):
        with pytest.raises(ValueError, match="mcd needs dropout layers"):
            create("mcd", model=plain).fit(None)
        with pytest.raises(ValueError, match="mcd needs dropout layers"):
            create("mcd", model=plain).score(Batch(inputs=x))
    with pytest.raises(ValueError, match="samples is the number of forward passes"):
        create("mcd", samples=0)
    with pytest.raises(ValueError, match=r"integer >= 2 for mode=var"):
        create("mcd", samples=1, mode="var")
    with pytest.raises(ValueError, match="mode must be one of"):
        create("mcd", mode="entropy")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["odin", "mcd"])
def test_model_detectors_on_cuda_put_the_model_back(name):
    model, x = TinyCNN(dropout=0.3), inputs()
    params = {"seed": 1} if name == "mcd" else {}
    on_cpu = create(name, model=copy.deepcopy(model), **params).score(Batch(inputs=x))
    det = create(name, model=model, **params)
    scores = det.score(Batch(inputs=x), device="cuda")  # CPU inputs, scored on the GPU
    assert scores.device.type == "cpu"
    assert all(p.device.type == "cpu" for p in model.parameters()) and not any(modes(model))
    if name == "odin":  # dropout masks on the GPU come from another generator than on the CPU
        torch.testing.assert_close(scores, on_cpu, rtol=1e-3, atol=1e-4)
    model.cuda()
    det.score(Batch(inputs=x.cuda()))  # device=None: the batch's device
    assert all(p.device.type == "cuda" for p in model.parameters())
    with pytest.raises(RuntimeError):
        det.score(Batch(inputs=torch.randn(4, 2, 8, 8)), device="cuda")
    assert all(p.device.type == "cuda" for p in model.parameters()) and not any(modes(model))


# ---- the engine's input stream -----------------------------------------------------------------


class ImageList:
    """``dataset[i] -> (image tensor [3, 8, 8], label, source index)``; item 5 is unreadable (None)."""

    name = "image-list"
    classes = None

    def __init__(self, n=23, broken=(5,)):
        self.x = inputs(n, seed=4)
        self.broken = set(broken)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i in self.broken:
            return None
        return self.x[i], i % 5, 100 + i


class Flaky(nn.Module):
    """TinyCNN that runs out of memory for batches above ``oom_above`` samples (CUDA's error, or ``message``)."""

    def __init__(self, oom_above=None, dropout=0.0, message=None):
        super().__init__()
        self.inner = TinyCNN(dropout=dropout)
        self.oom_above = oom_above
        self.message = message
        self.sizes = []

    def forward(self, x):
        self.sizes.append(len(x))
        if self.oom_above is not None and len(x) > self.oom_above:
            if self.message is not None:
                raise RuntimeError(self.message)
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(x)} GiB")
        return self.inner(x)


def flaky_backbone(oom_above=None, message=None, dropout=0.0):
    model = Flaky(oom_above, dropout=dropout, message=message)
    return wrap_model(model, lambda image: image, head="inner.fc", input_shape=(3, 8, 8), name="flaky")


def test_score_inputs_keeps_dataset_order_and_skips_unreadable_items():
    bb = flaky_backbone()
    dataset = ImageList()
    det = create("odin", model=bb, temperature=1.0, epsilon=0.01)
    seen = []
    result = score_inputs(lambda b: det.score(b), bb, dataset, batch_size=4, progress=lambda *a: seen.append(a))
    keep = [i for i in range(len(dataset)) if i not in dataset.broken]
    assert result.indices.tolist() == [100 + i for i in keep] and result.labels.tolist() == [i % 5 for i in keep]
    assert result.skipped == 1 and result.oom_backoffs == 0
    expected = det.score(Batch(inputs=dataset.x[keep]))
    torch.testing.assert_close(result.scores, expected, rtol=1e-5, atol=1e-6)
    assert seen[-1][0] == seen[-1][1] == len(dataset) and seen[-1][2]["stage"] == "done"


@pytest.mark.kernels
def test_score_inputs_backs_off_on_out_of_memory_with_identical_scores():
    dataset = ImageList(n=11, broken=())
    plain = flaky_backbone()
    at_two = score_inputs(lambda b: create("odin", model=plain).score(b), plain, dataset, batch_size=2)
    flaky = flaky_backbone(oom_above=2)
    det = create("odin", model=flaky)
    result = score_inputs(lambda b: det.score(b), flaky, dataset, batch_size=8)
    assert flaky.model.sizes[:4] == [1, 8, 4, 2]  # the one-input memory measurement, then 8 fails, 4 fails, 2s
    assert result.batch_size_in_force == 2 and result.oom_backoffs == 2
    assert torch.equal(result.scores, at_two.scores)
    assert np.array_equal(result.indices, at_two.indices)
    hopeless = flaky_backbone(oom_above=0)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="even at batch size 1 while scoring flaky inputs"):
        score_inputs(lambda b: create("odin", model=hopeless).score(b), hopeless, dataset, batch_size=4)
    assert hopeless.model.sizes == [1, 1, 1]  # even the one-input measurement runs out, at 4, 2 and 1


CPU_OOM = "[enforce fail at alloc_cpu.cpp:118] . DefaultCPUAllocator: can't allocate memory: you tried to allocate 98"


@pytest.mark.kernels
@pytest.mark.parametrize("detector", ["odin", "mcd"])
def test_score_inputs_backs_off_on_host_out_of_memory_with_identical_scores(detector):
    """The CPU allocator's error on the first big batch: halved and retried as CUDA's is, the same scores."""
    dataset = ImageList(n=11, broken=())
    params, dropout = ({"samples": 3}, 0.3) if detector == "mcd" else ({}, 0.0)
    plain = flaky_backbone(dropout=dropout)
    torch.manual_seed(0)
    at_two = score_inputs(lambda b: create(detector, model=plain, **params).score(b), plain, dataset, batch_size=2)
    flaky = flaky_backbone(oom_above=2, message=CPU_OOM, dropout=dropout)
    det = create(detector, model=flaky, **params)
    torch.manual_seed(0)
    result = score_inputs(lambda b: det.score(b), flaky, dataset, batch_size=8)
    assert flaky.model.sizes[:4] == [1, 8, 4, 2] and result.oom_backoffs == 2 and result.batch_size_in_force == 2
    assert torch.equal(result.scores, at_two.scores)
    hopeless = flaky_backbone(oom_above=0, message=CPU_OOM, dropout=dropout)
    with pytest.raises(MemoryError, match="even at batch size 1 while scoring flaky inputs"):
        score_inputs(lambda b: create(detector, model=hopeless, **params).score(b), hopeless, dataset, batch_size=4)


def test_score_inputs_cancels_and_restores_the_model():
    bb = flaky_backbone()
    bb.model.train()
    before = modes(bb.model)
    calls = []

    def should_cancel():
        calls.append(1)
        return len(calls) > 2

    with pytest.raises(Cancelled, match="cancelled after 4 of 23"):
        score_inputs(
            lambda b: create("odin", model=bb).score(b), bb, ImageList(), batch_size=2, should_cancel=should_cancel
        )
    assert modes(bb.model) == before
    with pytest.raises(ValueError, match="score returned 1 values for a batch of 2"):
        score_inputs(lambda b: torch.zeros(1), bb, ImageList(), batch_size=2)
    assert modes(bb.model) == before


# ---- runs ------------------------------------------------------------------------------------


def test_default_run_has_odin_and_gradnorm_but_not_mcd():
    names = [d.name for d in RunConfig().detectors]
    assert "odin" in names and "gradnorm" in names and "mcd" not in names
    problems = RunConfig(
        detectors=[
            DetectorChoice("odin", {"temperature": 0}),
            DetectorChoice("mcd", {"samples": 0}),
            DetectorChoice("odin"),
        ]
    ).problems()
    assert any("detectors[0] (odin): odin: temperature must be > 0" in p for p in problems)
    assert any("detectors[1] (mcd): mcd: samples" in p for p in problems)
    assert not any(p.startswith("detectors[2]") for p in problems)


def test_a_run_with_model_detectors_scores_them_in_store_order(tmp_path):
    import json

    from oodviz.config.splits import load_split
    from oodviz.models import load_backbone
    from oodviz.pipeline.reporter import Reporter
    from oodviz.pipeline.stages import run_pipeline
    from oodviz.runs.rundir import RunDir

    config = RunConfig(
        ood=[DatasetChoice("digits-heldout"), DatasetChoice("noise-uniform", params={"n": 200})],
        detectors=[
            DetectorChoice("msp"),
            DetectorChoice("odin", {"temperature": 100.0}),
            DetectorChoice("gradnorm"),
            DetectorChoice("mcd"),
        ],
        batch_size=128,
    ).validate()
    run = RunDir.create(tmp_path, config.to_dict())
    run_pipeline(config, run, Reporter(run))
    scores = pd.read_parquet(run.path / "scores.parquet")
    assert list(scores.columns[5:]) == ["msp", "odin", "gradnorm"]
    assert np.isfinite(scores[["odin", "gradnorm"]].to_numpy()).all()
    log = json.loads((run.path / "detectors.json").read_text())
    assert (
        log["odin"]["params"] == {"temperature": 100.0, "epsilon": 0.0014, "norm_std": "auto"}
        and "error" not in log["odin"]
    )
    assert "mcd needs dropout layers" in log["mcd"]["error"]  # digits-cnn has none: recorded, the others go on
    metrics = pd.read_csv(run.path / "metrics.csv")
    assert set(metrics.detector) == {"msp", "odin", "gradnorm"}
    stages = json.loads((run.path / "meta.json").read_text())["stages"]
    assert {"score id_test with odin", "score ood:noise-uniform with odin"} <= set(stages)
    events = [
        e for e in run.read_events() if e.get("stage") == "score id_test with odin" and e.get("event") == "progress"
    ]
    assert events and events[-1]["done"] == events[-1]["total"] == 362
    # The odin column is the detector applied to the split's images, row for row.
    bb = load_backbone("digits-cnn")
    dataset = load_split(config, config.id_test, False)
    images = torch.stack([bb.transform(dataset[i][0]) for i in range(len(dataset))])
    expected = create("odin", model=bb, temperature=100.0).score(Batch(inputs=images)).numpy()
    id_rows = scores[scores.split == "id_test"]
    assert id_rows["index"].tolist() == [dataset[i][2] for i in range(len(dataset))]
    np.testing.assert_allclose(id_rows["odin"].to_numpy(), expected, rtol=1e-5, atol=1e-7)


def test_odin_and_mcd_score_in_batches_sized_from_memory(monkeypatch):
    """Leaf outputs of this model for one input: 48 + 3 x 1000 + 10 floats = 12232 bytes. With 0.5 x available
    = 2 x 12232 x 10 (ODIN keeps 2 copies), ODIN scores 10 inputs at a time; MCD (1 copy) 20 - with the scores of
    batches of that size."""
    from oodviz.detectors import modelmemory

    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 1000), nn.ReLU(), nn.Dropout(0.2), nn.Linear(1000, 10))
    sizes = []
    model[1].register_forward_hook(lambda m, i, o: sizes.append(len(o)))
    monkeypatch.setattr(modelmemory, "available_bytes", lambda device: 2 * (2 * 12232 * 10))
    x = torch.randn(35, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    odin = create("odin", model=model, temperature=10.0, epsilon=0.01)
    scores = odin.score(Batch(inputs=x))
    assert sizes[0] == 1 and set(sizes[1:]) == {10, 5}  # the measuring pass, then chunks of 10
    expected = torch.cat(
        [
            create("odin", model=model, temperature=10.0, epsilon=0.01).score(Batch(inputs=x[i : i + 1]))
            for i in range(35)
        ]
    )
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    sizes.clear()
    mcd = create("mcd", model=model, samples=2)
    mcd.score(Batch(inputs=x))
    assert sizes[0] == 1 and sorted(set(sizes[1:])) == [15, 20]


# ---- adascale, rankfeat, gram, mahalanobis_odin, mds_ensemble, nac: in a run, the model kept, on the GPU ------


def test_a_run_fits_and_scores_the_new_detectors_on_the_bundled_model(tmp_path):
    """adascale, gram, mahalanobis_odin, mds_ensemble and nac fit on the ID fit split's images inside the run (the
    pipeline's own pass), and give what the library gives on the same images."""
    import json

    import pandas as pd

    from oodviz.config.run import DatasetChoice, DetectorChoice, RunConfig
    from oodviz.config.splits import load_split
    from oodviz.models import load_backbone
    from oodviz.pipeline.reporter import Reporter
    from oodviz.pipeline.stages import run_pipeline
    from oodviz.runs.rundir import RunDir

    names = ["msp", "adascale", "gram", "mahalanobis_odin", "mds_ensemble", "nac"]
    gram_params = {"layers": ["features.3", "features.6"], "poles": 2}
    ensemble_params = {"layers": ["features.1", "features.3", "features.6"]}
    nac_params = {"layers": ["features.3", "penultimate"], "alpha": [5.0, 100.0], "bins": 20, "o_star": 20}
    config = RunConfig(
        id_fit=DatasetChoice("digits-test"),  # 362 images, not 1081: the fit passes stay short
        ood=[DatasetChoice("noise-uniform", params={"n": 100})],
        detectors=[
            DetectorChoice(n, {"gram": gram_params, "mds_ensemble": ensemble_params, "nac": nac_params}.get(n, {}))
            for n in names
        ],
        batch_size=128,
    ).validate()
    run = RunDir.create(tmp_path, config.to_dict())
    run_pipeline(config, run, Reporter(run))
    log = json.loads((run.path / "detectors.json").read_text())
    assert not [n for n in names if "error" in log[n]], log
    scores = pd.read_parquet(run.path / "scores.parquet")
    assert list(scores.columns[5:]) == names
    assert set(pd.read_csv(run.path / "metrics.csv").detector) == set(names)
    bb = load_backbone("digits-cnn")
    fit_set, test_set = load_split(config, config.id_fit, False), load_split(config, config.id_test, False)
    fit_x = torch.stack([bb.transform(fit_set[i][0]) for i in range(len(fit_set))])
    fit_y = torch.tensor([fit_set[i][1] for i in range(len(fit_set))])
    test_x = torch.stack([bb.transform(test_set[i][0]) for i in range(len(test_set))])
    id_rows = scores[scores.split == "id_test"]
    for name, params in (
        ("adascale", {}),
        ("gram", gram_params),
        ("mahalanobis_odin", {}),
        ("mds_ensemble", ensemble_params),
        ("nac", nac_params),
    ):
        det = create(name, model=bb, **params).fit([Batch(inputs=fit_x, labels=fit_y)])
        expected = det.score(Batch(inputs=test_x)).numpy()
        np.testing.assert_allclose(id_rows[name].to_numpy(), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["adascale", "rankfeat", "gram", "mahalanobis_odin", "mds_ensemble", "nac"])
def test_model_based_ones_ask_for_the_model_and_keep_it_as_it_was(name):
    x, y = labelled_images(20)
    with pytest.raises(ValueError, match=rf"create\('{name}', model=\.\.\.\)"):
        create(name).score(Batch(inputs=x))
    with pytest.raises(ValueError, match=rf"create\('{name}', model=\.\.\.\)"):
        create(name).fit([Batch(inputs=x, labels=y)])
    model = WideCNN()
    model.train()
    model.body[0].eval()
    before = [m.training for m in model.modules()]
    params = {
        "adascale": {"k1": 10.0, "k2": 5.0},
        "gram": {"poles": 2},
        "mds_ensemble": {"layers": ["body.1", "body.3"]},
        "nac": {"layers": ["body.1", "penultimate"], "alpha": [1.0, 100.0], "bins": 20, "o_star": 5},
    }
    params = params.get(name, {})
    det = create(name, model=wide_backbone_of(model), **params).fit([Batch(inputs=x, labels=y)])
    scores = det.score(Batch(inputs=x))
    assert scores.shape == (20,) and torch.isfinite(scores).all()
    assert [m.training for m in model.modules()] == before
    assert all(p.grad is None for p in model.parameters())
    assert not model.body[0]._forward_hooks and not model.body._forward_hooks  # hooks removed


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["adascale", "rankfeat", "gram", "mahalanobis_odin", "mds_ensemble", "nac"])
def test_model_based_ones_fit_and_score_on_the_gpu_as_on_the_cpu(name):
    x, y = labelled_images(40)
    params = {
        "adascale": {"k1": 10.0, "k2": 5.0},
        "gram": {"poles": 2},
        "mds_ensemble": {"layers": ["body.1", "body.3"]},
        "nac": {"layers": ["body.1", "penultimate"], "alpha": [1.0, 100.0], "bins": 20, "o_star": 5},
    }
    params = params.get(name, {})
    model = WideCNN()
    on_cpu = create(name, model=model, **params).fit([Batch(inputs=x, labels=y)], head=model.fc)
    on_gpu = create(name, model=model, **params).fit([Batch(inputs=x, labels=y)], head=model.fc, device="cuda")
    assert all(p.device.type == "cpu" for p in model.parameters())  # put back
    expected = on_cpu.score(Batch(inputs=x))
    torch.testing.assert_close(on_gpu.score(Batch(inputs=x.cuda())), expected, rtol=1e-3, atol=1e-3)
