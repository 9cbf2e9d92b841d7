"""oodviz.detectors.iodin: against float64 references written here (a closed form on a linear model; OpenOOD's
``iodin`` postprocessor written out from its code, not imported, on a CNN), the one-element step itself, and what it
shares with odin (eval mode, frozen parameters, inference mode, ``norm_std``, batching, the GPU)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from detector_checks import spearman
from helpers import cuda
from kernels import assert_kernel_close
from tiny_cnn import TinyCNN, backbone_of, inputs
from torch import nn

from oodviz import Batch
from oodviz.config.run import DetectorChoice, RunConfig
from oodviz.detectors import create, detector_class, load
from oodviz.models import wrap_model


def linear_model(seed=3, n_classes=5):
    """``Flatten -> Linear(192, C)`` with float64-exact weights, and the weights in float64."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n_classes, 3 * 8 * 8, generator=g, dtype=torch.float64) * 0.3
    bias = torch.randn(n_classes, generator=g, dtype=torch.float64)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, n_classes))
    with torch.no_grad():
        model[1].weight.copy_(weight)
        model[1].bias.copy_(bias)
    return model, weight.float().double(), bias.float().double()


def closed_form(x, weight, bias, temperature, epsilon, std):
    """i-ODIN in float64 for logits ``W x + b``: the input gradient of ``-log S_y(x; T)`` is ``-(W_y - S W) / T``
    (no autograd); the step at its largest element only. Returns (scores, the moved element, its step, the largest
    ``|gradient|``)."""
    flat = x.double().flatten(1)
    s = torch.softmax((flat @ weight.T + bias) / temperature, dim=1)
    gradient = -(weight[s.argmax(dim=1)] - s @ weight) / temperature  # [B, 192]
    j = gradient.abs().argmax(dim=1)
    channel = j // 64  # [B, 3, 8, 8] flattened: 64 elements a channel
    divisor = (
        torch.ones(len(x), dtype=torch.float64) if std is None else torch.tensor(std, dtype=torch.float64)[channel]
    )
    step = gradient.gather(1, j[:, None]).squeeze(1).sign() / divisor
    moved = flat.clone()
    moved[torch.arange(len(x)), j] -= epsilon * step
    scores = -torch.softmax((moved @ weight.T + bias) / temperature, dim=1).amax(dim=1)
    return scores, j, -epsilon * step, gradient.abs().amax(dim=1)


@pytest.mark.parametrize(
    "temperature, epsilon, std", [(1000.0, 0.0014, None), (2.0, 0.5, [0.5, 1.0, 2.0]), (1.0, 0.3, None)]
)
def test_equals_a_float64_closed_form_on_a_linear_model(temperature, epsilon, std):
    model, weight, bias = linear_model()
    x = inputs()
    det = create("iodin", model=model, temperature=temperature, epsilon=epsilon, norm_std=std)
    ours = det.score(Batch(inputs=x)).double()
    expected, j, step, largest = closed_form(x, weight, bias, temperature, epsilon, std)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # the step itself: one element per input, the one of the largest |gradient|, by -epsilon sign / std; compared
    # where the gradient is above float32's rounding (a softmax saturated to 1 - 3e-8 leaves a gradient of noise,
    # whose step changes the score by as little)
    moved = (det.perturb(x) - x).flatten(1).double()
    assert ((moved != 0).sum(dim=1) == 1).all()
    clear = largest > 1e-5 * largest.max()
    assert clear.float().mean() > 0.9
    assert torch.equal(moved.abs().argmax(dim=1)[clear], j[clear])
    torch.testing.assert_close(moved[clear, j[clear]], step[clear], rtol=1e-4, atol=1e-7)
    if epsilon > 0.1:  # the step is large enough to tell: not MSP at T, not odin's step at every element
        msp = -torch.softmax((x.double().flatten(1) @ weight.T + bias) / temperature, dim=1).amax(dim=1)
        odin = create("odin", model=model, temperature=temperature, epsilon=epsilon, norm_std=std)
        assert (expected - msp).abs().max() > 1e-2 and (expected < msp).float().mean() > 0.9  # more confident
        assert (expected - odin.score(Batch(inputs=x)).double()).abs().max() > 1e-2


def openood_iodin(net, x, temperature, noise, input_std):
    """OpenOOD v1.5's ``IODINPostprocessor.postprocess`` (openood/postprocessors/iodin_postprocessor.py) written out
    in float64: the batch-mean cross-entropy at T against the argmax, ``torch.ge(grad, 0)`` mapped to +-1 and divided
    by the per-channel std, kept at the argmax of ``|grad|`` over each sample's flattened ``C x H x W``, subtracted
    times ``noise``; returns its OOD score, ``-conf``."""
    data = x.double().clone().requires_grad_(True)
    output = net(data)
    labels = output.detach().argmax(axis=1)
    loss = nn.CrossEntropyLoss()(output / temperature, labels)
    loss.backward()
    grad = data.grad.detach()
    b, c, h, w = grad.shape
    abs_grad = grad.abs().view(b, -1)
    mask = torch.zeros_like(abs_grad, dtype=torch.uint8)
    mask.scatter_(1, torch.argmax(abs_grad, dim=1, keepdim=True), 1)
    mask = mask.view(b, c, h, w)
    gradient = (torch.ge(grad, 0).double() - 0.5) * 2
    for channel in range(3):
        gradient[:, channel] = gradient[:, channel] / input_std[channel]
    with torch.no_grad():
        output = net(torch.add(data.detach(), gradient * mask, alpha=-noise)) / temperature
        conf = torch.softmax(output, dim=1).max(dim=1).values
    return -conf


@pytest.mark.parametrize(
    "temperature, epsilon, std", [(1000.0, 0.0014, [0.5, 0.5, 0.5]), (1.0, 0.2, [0.2, 0.5, 1.5]), (10.0, 0.1, None)]
)
def test_equals_openood_iodin_written_out_in_float64_on_a_cnn(temperature, epsilon, std):
    model, x = TinyCNN(), inputs()
    ours = create("iodin", model=model, temperature=temperature, epsilon=epsilon, norm_std=std).score(Batch(inputs=x))
    net = copy.deepcopy(model).double().eval()
    expected = openood_iodin(net, x, temperature, epsilon, std or [1.0, 1.0, 1.0])
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6)
    assert spearman(ours, expected) > 0.9999
    if epsilon > 0.05:  # a step that matters, ten times the tolerance above: the scores are not MSP's at T
        with torch.no_grad():
            msp = -torch.softmax(net(x.double()) / temperature, dim=1).amax(dim=1)
        assert (expected - msp).abs().max() > 10 * (1e-6 + 1e-5 * expected.abs().max())


@pytest.mark.kernels
def test_batch_equals_per_sample_any_model_form_and_epsilon_zero_is_msp():
    model, x = TinyCNN(), inputs()
    det = create("iodin", model=model, temperature=1.0, epsilon=0.2)
    whole = det.score(Batch(inputs=x))
    one_by_one = torch.cat([det.score(Batch(inputs=x[i : i + 1])) for i in range(len(x))])
    assert_kernel_close(one_by_one, whole)
    assert_kernel_close(det.score([Batch(inputs=x[:7]), Batch(inputs=x[7:30]), Batch(inputs=x[30:])]), whole)
    for other in (backbone_of(model), lambda t: model(t), lambda t: (t.flatten(1), model(t))):
        torch.testing.assert_close(
            create("iodin", model=other, temperature=1.0, epsilon=0.2).score(Batch(inputs=x)), whole
        )
    msp = -torch.softmax(model(x), dim=1).amax(dim=1).detach()
    torch.testing.assert_close(create("iodin", model=model, temperature=1.0, epsilon=0).score(Batch(inputs=x)), msp)
    assert not torch.allclose(whole, msp, rtol=0, atol=1e-3)
    # the gradient step is odin's, kept at one element: where odin moves every element
    odin = create("odin", model=model, temperature=1.0, epsilon=0.2).perturb(x) - x
    ours = det.perturb(x) - x
    kept = ours != 0
    assert torch.equal(ours[kept], odin[kept]) and kept.flatten(1).sum(dim=1).eq(1).all()


def test_norm_std_auto_reads_the_backbone_transform_and_wrong_widths_are_named():
    from torchvision import transforms

    model, x = TinyCNN(), inputs()
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5, 0.5, 0.5], [0.2, 0.5, 1.5])])
    bb = wrap_model(model, normalize, head="fc", input_shape=(3, 8, 8))
    det = create("iodin", model=bb, temperature=1.0, epsilon=0.2)
    assert det.channel_std() == pytest.approx([0.2, 0.5, 1.5])
    explicit = create("iodin", model=model, temperature=1.0, epsilon=0.2, norm_std=[0.2, 0.5, 1.5])
    torch.testing.assert_close(det.score(Batch(inputs=x)), explicit.score(Batch(inputs=x)))
    moved = (det.perturb(x) - x).flatten(1)
    assert sorted({round(abs(v), 6) for v in moved[moved != 0].tolist()}) <= [0.133333, 0.4, 1.0]  # 0.2 / std
    with pytest.raises(ValueError, match="iodin: norm_std has 2 values but the inputs have 3 channels"):
        create("iodin", model=model, norm_std=[0.2, 0.3]).score(Batch(inputs=x))
    with pytest.raises(ValueError, match="iodin: norm_std must be 'auto', None"):
        create("iodin", norm_std=[0.2, -1])
    with pytest.raises(ValueError, match="iodin: temperature must be > 0"):
        create("iodin", temperature=0)
    with pytest.raises(ValueError, match="iodin: epsilon is a step size"):
        create("iodin", epsilon=-1)
    with pytest.raises(ValueError, match=r"create\('iodin', model=\.\.\.\)"):
        create("iodin").score(Batch(inputs=x))


def test_leaves_the_model_as_it_was_and_works_inside_inference_mode():
    model, x = TinyCNN(), inputs()
    model.train()  # batch norm in training mode would normalise by the batch and update its statistics
    model.conv1.eval()
    before = [m.training for m in model.modules()]
    running_mean = model.bn.running_mean.clone()
    model.conv2.weight.requires_grad_(False)
    scores = create("iodin", model=model, temperature=1.0, epsilon=0.2).score(Batch(inputs=x))
    assert [m.training for m in model.modules()] == before
    assert not model.conv2.weight.requires_grad and model.conv1.weight.requires_grad
    assert all(p.grad is None for p in model.parameters()) and torch.equal(model.bn.running_mean, running_mean)
    expected = openood_iodin(copy.deepcopy(model).double().eval(), x, 1.0, 0.2, [1.0, 1.0, 1.0])
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-6)  # scored in eval mode
    with torch.inference_mode():
        inside = create("iodin", model=model, temperature=1.0, epsilon=0.2).score(Batch(inputs=x.clone()))
    torch.testing.assert_close(inside, scores)


def test_is_declared_as_a_model_detector_outside_the_defaults_with_openoods_grid(tmp_path):
    cls = detector_class("iodin")
    assert cls.needs_model and not cls.needs_fit and not cls.mergeable and not cls.in_defaults
    assert cls.default_grid == {"temperature": (1.0, 10.0, 100.0, 1000.0), "epsilon": (0.0014, 0.0028)}
    assert cls.openood_params == {} and cls.activation_copies == 2
    assert create("iodin").get_params() == {"temperature": 1000.0, "epsilon": 0.0014, "norm_std": "auto", "model": None}
    assert "iodin" not in [d.name for d in RunConfig().detectors]
    assert RunConfig(detectors=[DetectorChoice("iodin", {"epsilon": 0.0098, "norm_std": 0.5})]).problems() == []
    model, x = TinyCNN(), inputs()
    det = create("iodin", model=model, temperature=10.0, epsilon=0.1, norm_std=[0.5, 1.0, 2.0])
    det.save(tmp_path / "iodin")
    loaded = load(tmp_path / "iodin", model=model)
    assert loaded.get_params() == det.get_params()
    assert torch.equal(loaded.score(Batch(inputs=x)), det.score(Batch(inputs=x)))


def test_a_zero_gradient_leaves_the_input_as_it_is():
    """Where the whole input gradient is zero (a constant model) oodviz's sign gives 0 and nothing moves; OpenOOD's
    ``torch.ge`` would move the first element (the docstring's one difference)."""
    x = inputs(n=4)
    constant = nn.Sequential(nn.Flatten(), nn.Linear(192, 5))
    with torch.no_grad():
        constant[1].weight.zero_()
    det = create("iodin", model=constant, temperature=1.0, epsilon=0.5)
    assert torch.equal(det.perturb(x), x)
    torch.testing.assert_close(det.score(Batch(inputs=x)), -F.softmax(constant(x), dim=1).amax(dim=1).detach())


@cuda
@pytest.mark.cuda
def test_on_the_gpu_as_on_the_cpu_and_under_half_precision_autocast():
    model, x = TinyCNN(), inputs()
    on_cpu = create("iodin", model=copy.deepcopy(model), temperature=1.0, epsilon=0.2).score(Batch(inputs=x))
    det = create("iodin", model=model, temperature=1.0, epsilon=0.2)
    torch.testing.assert_close(det.score(Batch(inputs=x), device="cuda"), on_cpu, rtol=1e-3, atol=1e-4)
    assert all(p.device.type == "cpu" for p in model.parameters())  # put back
    model.cuda()
    cold = create("iodin", model=model, temperature=1000.0, epsilon=0.0014)
    with torch.autocast("cuda", dtype=torch.float16):
        moved = (cold.perturb(x.cuda()) - x.cuda()).flatten(1)  # gradients of order W / T: not underflowed to 0
    assert (moved != 0).sum(dim=1).eq(1).all()
    expected = (create("iodin", model=copy.deepcopy(model).cpu(), temperature=1000.0).perturb(x) - x).flatten(1)
    assert torch.equal(moved.abs().argmax(dim=1).cpu(), expected.abs().argmax(dim=1))
    np.testing.assert_allclose(moved.sum(dim=1).cpu().numpy(), expected.sum(dim=1).numpy(), rtol=1e-6)


def test_a_run_scores_it_on_the_split_images_as_the_library_does(tmp_path):
    import json

    import pandas as pd

    from oodviz.config.run import DatasetChoice
    from oodviz.config.splits import load_split
    from oodviz.models import load_backbone
    from oodviz.pipeline.reporter import Reporter
    from oodviz.pipeline.stages import run_pipeline
    from oodviz.runs.rundir import RunDir

    params = {"temperature": 10.0, "epsilon": 0.05}
    config = RunConfig(
        id_fit=DatasetChoice("digits-test"),  # a short fit pass for msp's store
        ood=[DatasetChoice("noise-uniform", params={"n": 100})],
        detectors=[DetectorChoice("msp"), DetectorChoice("iodin", params)],
        batch_size=128,
    ).validate()
    run = RunDir.create(tmp_path, config.to_dict())
    run_pipeline(config, run, Reporter(run))
    log = json.loads((run.path / "detectors.json").read_text())
    assert "error" not in log["iodin"] and log["iodin"]["params"] == {**params, "norm_std": "auto"}
    scores = pd.read_parquet(run.path / "scores.parquet")
    assert list(scores.columns[5:]) == ["msp", "iodin"] and np.isfinite(scores["iodin"].to_numpy()).all()
    bb = load_backbone("digits-cnn")
    dataset = load_split(config, config.id_test, False)
    images = torch.stack([bb.transform(dataset[i][0]) for i in range(len(dataset))])
    expected = create("iodin", model=bb, **params).score(Batch(inputs=images)).numpy()
    np.testing.assert_allclose(scores[scores.split == "id_test"]["iodin"].to_numpy(), expected, rtol=1e-5, atol=1e-7)
