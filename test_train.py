"""Tests for train_cifar10.py, CPU only. Each checks behaviour against an expectation computed
independently of the code under test: by hand, with numpy, or from a property.

Run: python -m pytest -q -rs test_train.py
With CIFAR10_DIR pointing at a folder that holds cifar-10-batches-py/, also checks that copy.
"""
import atexit
import collections
import contextlib
import copy
import datetime
import errno
import gzip
import hashlib
import http.server
import importlib.machinery
import inspect
import io
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import types
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_cifar10 as T

SCRIPT = Path(__file__).resolve().parent / 'train_cifar10.py'

torch.set_num_threads(2)

# All that the suite writes, that of its subprocesses included (torch.compile's cache, pytest's
# tmp_path), goes into one folder, removed when the suite ends:
# the temporary directory is left as it was found.
SCRATCH = Path(tempfile.mkdtemp(prefix='test_train_'))
os.environ['TMPDIR'] = str(SCRATCH)
tempfile.tempdir = None  # tempfile.gettempdir() reads TMPDIR again
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# A generated dataset in the official layout: classes a network can tell apart
# ---------------------------------------------------------------------------------------------
def synthetic_images(labels, rng):
    """Class k: a colour of its own and stripes at an angle of its own, random phase and noise."""
    n = len(labels)
    yy, xx = np.mgrid[0:32, 0:32]
    angle = labels[:, None, None] * np.pi / 10
    phase = rng.uniform(0, 2 * np.pi, (n, 1, 1))
    stripes = np.sin((np.cos(angle) * xx + np.sin(angle) * yy) * 0.8 + phase)
    palette = np.random.default_rng(1).uniform(40, 215, (10, 3))
    images = palette[labels][:, :, None, None] + 35 * stripes[:, None] + rng.normal(0, 20, (n, 3, 32, 32))
    return np.clip(images, 0, 255).astype(np.uint8)


def write_batch(path, images, labels, batch_label):
    batch = {'batch_label': batch_label, 'labels': [int(x) for x in labels],
             'data': images.reshape(len(images), -1), 'filenames': [f'img{i}.png' for i in range(len(images))]}
    path.write_bytes(pickle.dumps(batch, protocol=2))


def write_dataset(data_dir, per_batch=200, n_test=200, seed=0):
    """data_dir/cifar-10-batches-py with five training batches and a test batch."""
    rng = np.random.default_rng(seed)
    folder = Path(data_dir) / T.BATCHES_DIR
    folder.mkdir(parents=True)
    for i in range(1, 6):
        labels = rng.integers(0, 10, per_batch)
        write_batch(folder / f'data_batch_{i}', synthetic_images(labels, rng), labels, f'training batch {i} of 5')
    labels = rng.integers(0, 10, n_test)
    write_batch(folder / 'test_batch', synthetic_images(labels, rng), labels, 'testing batch 1 of 1')
    return folder


@pytest.fixture(autouse=True)
def no_trainers_kept(monkeypatch):
    """Each test builds its own networks, as a new process would (T.TRAINERS keeps them by settings)."""
    monkeypatch.setattr(T, 'TRAINERS', {})


@pytest.fixture(scope='session')
def dataset(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp('generated')
    write_dataset(data_dir)
    return data_dir


def run_script(*args, cwd=None, timeout=300, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


def small_model(hyp_overrides=None, whitening=None):
    hyp = {**T.HYP, 'channels': (8, 8, 16, 16), **(hyp_overrides or {})}
    torch.manual_seed(0)
    return T.ResNet9(hyp, torch.randn(27, 3, 3, 3) if whitening is None else whitening), hyp


def small_networks(hyp_overrides=None, compiled=False, dtype=torch.float32):
    """A Trainer on the CPU, narrow, initialised from seed 0 with random whitening filters."""
    hyp = {**T.HYP, 'channels': (8, 8, 16, 16), **(hyp_overrides or {})}
    networks = T.Trainer(hyp, torch.device('cpu'), dtype, compiled)
    networks.new_run(hyp, 0, torch.randn(27, 3, 3, 3, generator=torch.Generator().manual_seed(1)))
    return networks, hyp


# ---------------------------------------------------------------------------------------------
# Whitening
# ---------------------------------------------------------------------------------------------
def correlated_images(n=64, seed=0):
    """Images whose neighbouring pixels and channels are strongly correlated, like photos."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 40, 40, generator=g)
    x = F.avg_pool2d(x, 5, stride=1)[:, :, :32, :32]             # spatial correlation
    mix = torch.tensor([[1.0, 0.8, 0.6], [0.0, 0.6, 0.5], [0.0, 0.0, 0.4]])
    return torch.einsum('ij,njhw->nihw', mix, x)                  # channel correlation


def patch_moment_numpy(images):
    """The 27 x 27 uncentred second moment X^T X / (N - 1) of all 3x3 patches, cut out one window
    at a time (Page's `cov`)."""
    x = images.numpy().astype(np.float64)
    n, c, h, w = x.shape
    patches = np.stack([x[:, :, i:i + 3, j:j + 3].reshape(n, -1) for i in range(h - 2) for j in range(w - 2)])
    patches = patches.reshape(-1, 27)
    return patches.T @ patches / (len(patches) - 1)


def test_whitened_patches_have_identity_second_moment():
    images = correlated_images() + 0.5                            # a mean far from 0: centring would matter
    filters = T.whitening_filters(images, eps=1e-9)
    whitened = F.conv2d(images, filters).permute(1, 0, 2, 3).reshape(27, -1).double().numpy()
    np.testing.assert_allclose(whitened @ whitened.T / (whitened.shape[1] - 1), np.eye(27), atol=2e-3)


def test_whitening_filters_follow_the_eigenvalues_of_the_uncentred_moment():
    images = correlated_images(seed=1) + 0.3
    eps = 1e-2
    filters = T.whitening_filters(images, eps).reshape(27, 27).double().numpy()
    moment = patch_moment_numpy(images)
    eigenvalues = np.sort(np.linalg.eigvalsh(moment))[::-1]
    # filter i is v_i / sqrt(l_i + eps), so it maps the moment to l_i / (l_i + eps) on the diagonal
    np.testing.assert_allclose(filters @ moment @ filters.T, np.diag(eigenvalues / (eigenvalues + eps)), atol=1e-5)


class NoFloat64Device(torch.Tensor):
    """A tensor on a simulated device that, like Apple's MPS, has no float64 and no unfold:
    any operation that would make a float64 tensor on it, or unfold it, raises as MPS does.
    .cpu() leaves the device and gives a plain CPU tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.unfold:
            raise NotImplementedError("The operator 'aten::im2col' is not currently implemented for the MPS device")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            if func is torch.Tensor.cpu:                          # here a no-op, which returns self
                return out.as_subclass(torch.Tensor)
        if isinstance(out, torch.Tensor):
            if out.dtype == torch.float64:
                raise TypeError('Cannot convert a MPS Tensor to float64 dtype as the MPS framework '
                                "doesn't support float64. Please use float32 instead.")
            return out.as_subclass(cls)
        return out


def test_whitening_runs_on_a_device_without_float64():
    images = correlated_images(seed=2) + 0.2
    with pytest.raises(TypeError, match='float64'):               # the simulation refuses float64
        images.as_subclass(NoFloat64Device).double()
    filters = T.whitening_filters(images.as_subclass(NoFloat64Device), eps=1e-2)
    expected = T.whitening_filters(images, eps=1e-2)
    torch.testing.assert_close(filters.as_subclass(torch.Tensor), expected)


# ---------------------------------------------------------------------------------------------
# Learning-rate schedule
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('epochs, epoch, expected', [
    (10, 0, 0.0), (10, 1, 0.5), (10, 2, 1.0),                     # warm-up to the peak at epochs/5
    (10, 5, 0.55), (10, 8, 0.1), (10, 9.5, 0.1), (10, 10, 0.1),   # down to the floor at epochs-2
    (20, 4, 1.0), (20, 11, 0.55), (20, 18, 0.1),                  # the knots scale with epochs
    (1, 0.2, 1.0), (1, 0.4, 0.55), (1, 0.6, 0.1), (2, 0.4, 1.0), (2, 1.2, 0.1),  # too short for 2 floor epochs
])
def test_schedule_at_and_between_knots(epochs, epoch, expected):
    assert T.lr_schedule({**T.HYP, 'epochs': epochs}, epoch) == pytest.approx(expected)


def test_each_step_uses_the_schedule_at_its_own_end(monkeypatch):
    """A run of 2 epochs of 3 steps steps at the schedule's value at the end of each step: 1/3, 2/3, 1, ...
    of an epoch, so that the first step's rate is not 0; a row's lr is its epoch's last."""
    networks, hyp = small_networks({'batch_size': 32, 'epochs': 2, 'floor_epochs': 1})
    rates = []
    real_optimiser = T.optimiser

    def optimiser(*args):
        opt = real_optimiser(*args)
        real_step = opt.step
        opt.step = lambda lr: (rates.append(lr), real_step(lr))
        return opt
    monkeypatch.setattr(T, 'optimiser', optimiser)
    data = constant_data(n_train=3 * 32 + 5)                      # 3 steps; the partial batch is dropped
    rows = T.train_run(data, T.upload_test_set(data, networks), networks, hyp, 0, lambda row: None)
    peak, floor = 2 / 5, 1                                        # epochs / 5, epochs - floor_epochs
    expected = np.interp(np.arange(1, 7) / 3, [0, peak, floor], [0, 1.0, 0.1])
    assert rates == pytest.approx(expected.tolist()) and rates[0] > 0
    assert [row['lr'] for row in rows] == pytest.approx([expected[2], expected[5]])


# ---------------------------------------------------------------------------------------------
# Augmentation
# ---------------------------------------------------------------------------------------------
# Page's per-channel statistics of CIFAR-10's training images, 0-255 scale, as his cifar10-fast
# writes them (cifar10_mean, cifar10_std): written here again, the expectation of normalise.
PAGE_MEAN, PAGE_STD = (125.31, 122.95, 113.87), (62.99, 62.09, 66.70)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_normalise_takes_pages_mean_and_standard_deviation_from_each_channel(dtype):
    images = np.random.default_rng(0).integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    images[0], images[1] = 0, 255                                 # the ends of the scale
    got = T.upload_normalised(images, torch.device('cpu'), dtype)
    mean, std = (np.array(s).reshape(1, 3, 1, 1) for s in (PAGE_MEAN, PAGE_STD))
    # |x| <= 2.1: fp32's rounding of the difference and the quotient is below 3 x 2^-24 x 2.1 < 1e-6;
    # fp16's last rounding is half a unit, 2^-11 of the value
    tolerance = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -11, atol=0)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.double().numpy(), (images - mean) / std, **tolerance)


def test_cutout_zeroes_the_square_at_its_corner_in_place():
    top, left = torch.tensor([0, 24, 10]), torch.tensor([0, 24, 3])
    images = torch.ones(3, 3, 32, 32)
    out = T.cutout(images, top, left, 8)
    assert out is images
    for image, y, x in zip(out, top.tolist(), left.tolist()):
        expected = torch.ones(3, 32, 32)
        expected[:, y:y + 8, x:x + 8] = 0
        assert torch.equal(image, expected)


def test_draws_are_balanced_as_in_pages_loader():
    """Page's loader gives each crop offset (at most 200 of them) an equal share of the images,
    assigned at random, and flips exactly half of them; cutout's corners (200 of 625) likewise."""
    order, top, left, flip, cut_top, cut_left = T.draw_augmentation(1000, {**T.HYP, 'cutout': 8},
                                                                    torch.Generator().manual_seed(0))
    assert sorted(order.tolist()) == list(range(1000)) and flip.sum() == 500
    offsets = np.bincount((top * 9 + left).numpy(), minlength=81)
    assert top.max() == left.max() == 8 and set(offsets.tolist()) == {12, 13}   # 1000 / 81 = 12.3: all 81 used
    corners = np.unique((cut_top * 25 + cut_left).numpy(), return_counts=True)[1]
    assert len(corners) == 200 and set(corners.tolist()) == {5}           # 625 squares: 200 picked, 5 images each
    again = T.draw_augmentation(1000, {**T.HYP, 'cutout': 8}, torch.Generator().manual_seed(1))
    assert not torch.equal(again[1], top) and not torch.equal(again[3], flip)
    assert len(T.draw_augmentation(1000, T.HYP, torch.Generator().manual_seed(0))) == 4   # no cutout: no corners


@pytest.mark.parametrize('layout', [torch.contiguous_format, torch.channels_last])
def test_an_epochs_images_are_the_drawn_windows_mirrored_and_cut_out_with_their_labels(layout):
    """Position p of the epoch holds image order[p]'s 32 x 32 window at (top[p], left[p]) of its
    padded image, mirrored where flip[p], its cutout square zeroed, in the step's layout; its label
    goes with it; the last partial batch is dropped."""
    n, hyp = 1000, {**T.HYP, 'batch_size': 64, 'cutout': 8}
    padded, labels = torch.rand(n, 3, 40, 40), torch.randint(0, 10, (n,))
    images, epoch_labels, steps = T.augmented_epoch(padded, labels, hyp, torch.Generator().manual_seed(0), layout)
    order, top, left, flip, cut_top, cut_left = T.draw_augmentation(n, hyp, torch.Generator().manual_seed(0))
    assert steps == n // 64 and images.shape == (steps * 64, 3, 32, 32) and images.is_contiguous(memory_format=layout)
    for p in range(steps * 64):
        window = padded[order[p], :, top[p]:top[p] + 32, left[p]:left[p] + 32].clone()
        if flip[p]:
            window = window.flip(2)
        window[:, cut_top[p]:cut_top[p] + 8, cut_left[p]:cut_left[p] + 8] = 0
        assert torch.equal(images[p], window) and epoch_labels[p] == labels[order[p]], p


def test_an_epochs_draws_reach_the_device_in_one_copy_and_no_work_grows_with_images_or_offsets():
    """A copy from the CPU to a GPU waits for the GPU: the epoch's draws go in one (a meta device
    stands for the GPU: a copy to it is an operation, as to a GPU). The kernels an epoch runs (views
    aside) are as many for 4 times the images and 3.6 times the offsets: no loop over either."""
    counts = []
    for n, pad in [(400, 4), (1620, 4), (400, 8)]:                # 81, 81 and 289 crop offsets
        padded = torch.empty(n, 3, 32 + 2 * pad, 32 + 2 * pad, device='meta')
        labels = torch.empty(n, dtype=torch.int64, device='meta')
        with OpLog() as log:
            images, _, _ = T.augmented_epoch(padded, labels, {**T.HYP, 'batch_size': 64, 'pad': pad, 'cutout': 8},
                                             torch.Generator().manual_seed(0), torch.channels_last)
        assert images.device.type == 'meta'
        assert log.ops.count('aten._to_copy') + log.ops.count('aten.copy_') == 1
        counts.append(len(log.kernels))
    assert counts[0] == counts[1] == counts[2]


class NewTensorLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the number of elements of every tensor an operation makes anew (not a view, not its
    input written in place)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if isinstance(out, torch.Tensor) and not func.is_view and not any(out is a for a in inputs):
            self.sizes.append(out.numel())
        return out


@pytest.mark.parametrize('layout, copies', [(torch.channels_last, 1), (torch.contiguous_format, 2)])
def test_an_epoch_copies_its_images_at_most_twice(layout, copies):
    """The gather writes the epoch's images once, in channels_last memory, as compiled steps read
    them; eager NCHW steps need one copy more. Cutout zeroes its squares in place; each step slices
    its batch out of them."""
    n = 1000
    padded, labels = torch.rand(n, 3, 40, 40), torch.randint(0, 10, (n,))
    with NewTensorLog() as log:
        images, _, _ = T.augmented_epoch(padded, labels, {**T.HYP, 'batch_size': 50, 'cutout': 8},
                                         torch.Generator().manual_seed(0), layout)
    assert sum(size >= images.numel() for size in log.sizes) == copies


def test_augmentation_is_the_same_whatever_the_device_and_its_random_state():
    """Ranks on unlike devices (another GPU model, another dtype) must train on the same images in
    the same order: the draws come from the run's CPU generator only."""
    padded = torch.rand(300, 3, 40, 40)
    labels = torch.randint(0, 10, (300,))
    hyp = {**T.HYP, 'batch_size': 64, 'cutout': 8}
    torch.manual_seed(1)
    a, a_labels, _ = T.augmented_epoch(padded, labels, hyp, torch.Generator().manual_seed(5), torch.channels_last)
    torch.manual_seed(2)                                          # another global random state ...
    b, b_labels, _ = T.augmented_epoch(padded.double(), labels, hyp, torch.Generator().manual_seed(5),  # ... dtype
                                       torch.contiguous_format)   # ... and layout
    assert torch.equal(a.double(), b) and torch.equal(a_labels, b_labels)


# ---------------------------------------------------------------------------------------------
# Network pieces
# ---------------------------------------------------------------------------------------------
class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every aten operation that runs, and in kernels those that run a kernel
    on the device: not views, nor allocations of empty tensors."""

    def __init__(self):
        super().__init__()
        self.ops, self.kernels = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        if not func.is_view and func.overloadpacket is not torch.ops.aten.empty:
            self.kernels.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('layout', [torch.contiguous_format, torch.channels_last])
def test_ghost_batch_norm_equals_batch_norm_of_each_split_by_hand_without_copies(layout):
    torch.manual_seed(0)
    bn = T.GhostBatchNorm(4, split_size=32)
    with torch.no_grad():
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    x = (torch.randn(96, 4, 5, 5) * 3 + 1).contiguous(memory_format=layout)   # 3 splits of 32
    with OpLog() as log:
        y = bn(x)
    assert not {'aten.clone', 'aten.copy_', 'aten._to_copy', 'aten.contiguous'} & set(log.ops)   # no copy
    assert y.is_contiguous(memory_format=layout)
    means, variances = [], []
    for k in range(3):                                            # split k: images k, k+3, k+6, ...
        chunk = x[k::3].double()
        mean = chunk.mean(dim=(0, 2, 3), keepdim=True)
        var = chunk.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
        expected = (chunk - mean) / torch.sqrt(var + 1e-5) + bn.bias.double().view(1, 4, 1, 1)
        torch.testing.assert_close(y[k::3].double(), expected, atol=1e-5, rtol=1e-5)
        means.append(mean.flatten())
        variances.append(chunk.var(dim=(0, 2, 3), unbiased=True))
    # running statistics: momentum 0.1 from (0, 1) towards the average over splits
    torch.testing.assert_close(bn.running_mean.double(), 0.1 * torch.stack(means).mean(0), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), 0.9 + 0.1 * torch.stack(variances).mean(0), atol=1e-6, rtol=1e-6)
    assert not bn.weight.requires_grad and bn.bias.requires_grad and (bn.weight == 1).all()


@pytest.mark.parametrize('layout', [torch.contiguous_format, torch.channels_last])  # eager's and compiled's paths
def test_ghost_batch_norm_gradient_equals_batch_norm_of_each_split(layout):
    x = torch.randn(64, 3, 4, 4, dtype=torch.float64).contiguous(memory_format=layout).requires_grad_(True)
    bn = T.GhostBatchNorm(3, split_size=32).double()
    upstream = torch.randn(64, 3, 4, 4, dtype=torch.float64)
    (bn(x) * upstream).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.empty_like(x2)
    for k in range(2):                                            # torch's own batch norm, one split at a time
        y2[k::2] = F.batch_norm(x2[k::2], None, None, training=True, bias=bn.bias.detach())
    (y2 * upstream).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


class PagesGhostBatchNorm(torch.nn.BatchNorm2d):
    """Page's ghost batch norm in training, as his torch_backend.GhostBatchNorm computes it: one
    F.batch_norm over the splits as channels."""

    def __init__(self, channels, split_size, frozen_scale=True):
        super().__init__(channels)
        self.split_size = split_size
        self.weight.requires_grad_(not frozen_scale)

    def forward(self, x):
        n, c, h, w = x.shape
        splits = n // self.split_size
        return F.batch_norm(x.reshape(-1, c * splits, h, w), self.running_mean.repeat(splits),
                            self.running_var.repeat(splits), self.weight.repeat(splits),
                            self.bias.repeat(splits), True, self.momentum, self.eps).view_as(x)


RATES = T.lr_schedule(T.HYP, np.array([1, 2]) / 97).tolist()  # the first two steps' rates, 0.005 and 0.010


def two_steps(dtype, layout=torch.contiguous_format, sums=None):
    """The batch-norm biases after two optimiser steps of --tiny's network at batch 64 (the rates of
    steps 1 and 2 of 97 per epoch), from seed 0's weights, on 128 images like photos, in dtype and
    layout. sums, if given, gets for each batch norm and step the sum over images and pixels of |the
    gradient of its output|, per channel, and the number of its terms."""
    hyp = {**T.HYP, **T.TINY, 'batch_size': 64}
    networks = T.Trainer(hyp, torch.device('cpu'), dtype, False)
    x = correlated_images(128).double()
    networks.new_run(hyp, 0, T.whitening_filters(x, 1e-2).to(T.at_least_fp32(dtype)))
    for name, module in networks.network.named_modules():
        if sums is not None and isinstance(module, torch.nn.BatchNorm2d):
            module.register_full_backward_hook(lambda m, grad_in, grad_out, name=name: sums.setdefault(
                name, []).append((grad_out[0].abs().sum((0, 2, 3)).double(), grad_out[0][:, 0].numel())))
    labels = torch.arange(128) % 10
    T.train_epoch(networks, x.to(dtype).contiguous(memory_format=layout), labels, RATES, hyp)
    return {name: p.detach().double() for name, p in networks.network.named_parameters() if name.endswith('bias')}


def test_ghost_batch_norms_fp32_steps_are_as_near_float64_as_pages_and_within_fp32s_rounding(monkeypatch):
    """Two optimiser steps in fp32 against the same steps in float64, the file's own code in both. A
    bias's step sums the gradient of its batch norm's output over the n images and pixels of the
    batch (64 x 32 x 32 to 64 x 4 x 4). fp32 rounds a sum of n terms by at most n units of 2^-24 of
    its terms' absolute sum (added one after another; other orders round less), and two steps with
    Nesterov's momentum of 0.9 move a bias by less than twice their sum. So each bias may be 2 x n x
    2^-24 x the sum over the steps of lr x that absolute sum from float64 (measured: at most 0.6 %
    of it, 5 % under SSE4.1's kernels). Eager (NCHW) is no farther from float64 than Page's
    F.batch_norm over the splits as channels in any bias; channels_last's var_mean, which the
    compiler fuses, keeps the bound too."""
    sums = {}
    exact = two_steps(torch.float64, sums=sums)
    eager = two_steps(torch.float32)
    channels_last = two_steps(torch.float32, torch.channels_last)
    monkeypatch.setattr(T, 'GhostBatchNorm', PagesGhostBatchNorm)
    pages = two_steps(torch.float32)
    for name, bias in exact.items():
        (first, n), (second, _) = sums[name.rsplit('.', 1)[0]]
        bound = 2 * n * 2 ** -24 * (RATES[0] * first + RATES[1] * second)   # bias lr x 64 / 64
        for got in (eager, channels_last):
            assert ((got[name] - bias).abs() <= bound).all(), name
        assert ((eager[name] - bias).abs() <= (pages[name] - bias).abs()).all(), name


@pytest.mark.parametrize('dtype', [torch.float16])
@pytest.mark.parametrize('layout', [torch.contiguous_format, torch.channels_last])
def test_ghost_batch_norm_in_half_precision_keeps_fp32_statistics(dtype, layout):
    """Half input, fp32 batch norm (as to_training_precision leaves it): each path's output and input
    gradient are the float64 ones rounded to the dtype, up to a unit in its last place (eps x the
    largest value); the running statistics, fp32, agree with float64's to fp32 rounding."""
    torch.manual_seed(0)
    x = (torch.randn(128, 8, 6, 6) * 3 + 1).to(dtype).contiguous(memory_format=layout)
    upstream = torch.randn(128, 8, 6, 6).to(dtype)
    results = []
    for wide in (False, True):
        bn = T.GhostBatchNorm(8, split_size=32)
        if wide:
            bn.double()
        xi = (x.double() if wide else x).detach().requires_grad_(True)
        y = bn(xi)
        y.backward(upstream.to(y.dtype))
        results.append((y.detach(), xi.grad, bn.running_mean, bn.running_var))
    eps = torch.finfo(dtype).eps
    for got, exact in zip(results[0][:2], results[1][:2]):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=eps * float(exact.abs().max()))
    for got, exact in zip(results[0][2:], results[1][2:]):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)


def test_conversion_keeps_batch_norm_in_fp32_and_the_rest_in_half():
    model, _ = small_model()
    T.to_training_precision(model, torch.float16)
    for module in model.modules():
        if isinstance(module, T.GhostBatchNorm):
            assert {t.dtype for t in (module.weight, module.bias, module.running_mean, module.running_var)} == {torch.float32}
        elif isinstance(module, (T.WhitenedPrep, torch.nn.Conv2d, torch.nn.Linear)):
            assert module.weight.dtype == torch.float16
    assert model.prep[0].whitening.dtype == torch.float32                 # fixed filters, folded in fp32
    out = model(torch.randn(64, 3, 32, 32, dtype=torch.float16))
    assert out.dtype == torch.float16 and out.shape == (64, 10)


def test_whitened_prep_is_the_whitening_conv_then_the_1x1_conv_forward_and_backward():
    """The folded 3x3 conv equals the fixed whitening conv followed by the 1x1 prep conv, in
    float64 to 1e-12, and so does the prep weights' gradient (the data gets none)."""
    g = torch.Generator().manual_seed(0)
    whitening = torch.randn(27, 3, 3, 3, generator=g, dtype=torch.float64)
    prep = T.WhitenedPrep(whitening, 16).double()
    x, upstream = torch.randn(8, 3, 12, 12, generator=g, dtype=torch.float64), torch.randn(8, 16, 12, 12, generator=g, dtype=torch.float64)
    (prep(x) * upstream).sum().backward()
    weight = prep.weight.detach().clone().requires_grad_(True)
    two_convs = F.conv2d(F.conv2d(x, whitening, padding=1), weight[:, :, None, None])
    (two_convs * upstream).sum().backward()
    torch.testing.assert_close(prep(x), two_convs, rtol=1e-12, atol=1e-12)     # gradients are ~300: relative
    torch.testing.assert_close(prep.weight.grad, weight.grad, rtol=1e-12, atol=1e-12)
    assert [name for name, _ in prep.named_parameters()] == ['weight']   # the whitening is a buffer


def test_whitened_prep_keeps_the_1x1_gradient_accurate_in_half_precision():
    """Folded, the 1x1 weights' gradient is the filters' gradient projected on the whitening filters,
    whose small-eigenvalue directions cancel most of it: rounded to fp16 first, it would lose up to
    2 %. Formed in fp32, it stays within twice fp16's rounding (its epsilon, 2^-10, relative to the
    largest of each input's gradients) of the two-conv form's (measured: 0.7 of it)."""
    images = correlated_images(32)
    whitening = T.whitening_filters(images, 1e-2).half()
    prep = T.WhitenedPrep(whitening, 16).half()
    x = images.half()
    upstream = torch.randn(32, 16, 32, 32, generator=torch.Generator().manual_seed(0)).half()
    (prep(x).float() * upstream.float()).sum().backward()
    z = F.conv2d(x.double(), whitening.double(), padding=1)       # float64 from the same fp16 values
    exact = torch.einsum('nohw,nkhw->ok', upstream.double(), z)
    error = (prep.weight.grad.double().flatten(1) - exact).abs().amax(0) / exact.abs().amax(0)   # per 1x1 input
    assert error.max() < 2 * torch.finfo(torch.float16).eps


def test_flip_tta_gives_an_image_and_its_mirror_the_same_logits():
    model, _ = small_model()
    model(torch.randn(64, 3, 32, 32))                             # move the BN statistics off (0, 1)
    model.eval()
    x = torch.randn(16, 3, 32, 32)
    with torch.no_grad():
        plain, tta = T.flip_tta_logits(model, x)
        torch.testing.assert_close(plain, model(x))                # the first view: the image alone
        torch.testing.assert_close(tta, (model(x) + model(x.flip(3))) / 2)
        assert torch.equal(tta, T.flip_tta_logits(model, x.flip(3))[1])
        assert not torch.equal(model(x), model(x.flip(3)))        # the network itself is not symmetric


def test_network_shapes_and_logit_scale():
    model, hyp = small_model()
    model.eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        one_by_one = model.prep[0].weight[:, :, None, None]       # the 1x1 conv's weights
        whitened = F.conv2d(F.conv2d(x, model.prep[0].whitening, padding=1), one_by_one)   # the two convs
        features = model.layer3(model.layer2(model.layer1(model.prep[2](model.prep[1](whitened)))))
        assert features.shape == (4, 16, 4, 4)                   # three 2x2 pools: 32 -> 4
        expected = features.amax(dim=(2, 3)) @ model.head.weight.T / 16
        torch.testing.assert_close(model(x), expected)


def test_reinitialised_networks_equal_a_newly_built_network():
    networks, hyp = small_networks({'batch_size': 64})
    T.train_epoch(networks, torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,)), [0.5] * 2, hyp)
    whitening = torch.randn(27, 3, 3, 3)
    networks.new_run(hyp, 3, whitening)
    torch.manual_seed(3)
    fresh = T.ResNet9(hyp, whitening).state_dict()
    for model in (networks.network, networks.ema):
        assert all(torch.equal(model.state_dict()[k], fresh[k]) for k in fresh)
    assert all((v == 0).all() for g in networks.optimiser.groups for v in g['velocities'])


def test_a_layer_whose_weights_new_run_does_not_draw_is_refused_not_left_as_the_last_runs(monkeypatch):
    """A layer added to the network whose weights new_run() does not draw would start every run from
    the last run's weights: new_run() names it instead, before any step."""
    class Extended(T.ResNet9):
        def __init__(self, hyp, whitening=None):
            super().__init__(hyp, whitening)
            self.attention = torch.nn.MultiheadAttention(4, 2)
    monkeypatch.setattr(T, 'ResNet9', Extended)
    networks = T.Trainer({**T.HYP, 'channels': (8, 8, 16, 16)}, torch.device('cpu'), torch.float32, False)
    with pytest.raises(TypeError, match='new_run.. draws no weights for a MultiheadAttention: add them there'):
        networks.new_run(T.HYP, 0, torch.randn(27, 3, 3, 3))


# ---------------------------------------------------------------------------------------------
# Training pieces
# ---------------------------------------------------------------------------------------------
def test_one_ema_step_equals_the_formula():
    model, _ = small_model()
    ema, _ = small_model()
    with torch.no_grad():
        for t in ema.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t))
    model(torch.randn(64, 3, 32, 32))                             # running statistics differ too
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    T.ema_update(T.averaged_tensors(ema), T.averaged_tensors(model), 0.9)
    for k, v in ema.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(v, 0.9 * before[k] + 0.1 * model.state_dict()[k], atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(v, before[k])                      # the batch counter is not averaged


@pytest.mark.parametrize('momentum, expected', [(1e-30, [1, 6, 8, 13]), (0.0, [7, 14])])
def test_ema_updates_after_batches_0_5_10_of_every_epoch(momentum, expected):
    """Page's EMA step is made anew each epoch and fires on its batches 0, 5, 10, ...; with a
    momentum of 1e-30 (1e-150 a 5-step update, nothing in fp32) the EMA is a copy of the model as it
    was after the last update's step. Momentum 0 is no EMA: the last step's weights alone are copied."""
    networks, hyp = small_networks({'batch_size': 32, 'epochs': 4, 'ema_momentum': momentum})
    after_step, fired = [], []
    real_step, real_update = networks.optimiser.step, T.ema_update
    networks.optimiser.step = lambda lr: (real_step(lr), after_step.append(networks.network.head.weight.detach().clone()))
    images, labels = torch.randn(7 * 32, 3, 32, 32), torch.randint(0, 10, (7 * 32,))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(T, 'ema_update', lambda *args: (fired.append(len(after_step)), real_update(*args)))
        for epoch in range(2):
            T.train_epoch(networks, images, labels, [0.5] * 7, hyp)
    assert fired == expected                                      # batches 0 and 5 of each 7-step epoch
    ema, last = networks.ema.head.weight, fired[-1] - 1
    assert torch.equal(ema, after_step[last]) and not torch.equal(ema, after_step[last - 1])


class SyncLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the host syncs: .item(), bool(tensor) and .tolist() all call aten._local_scalar_dense."""

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_no_host_sync_in_an_epoch_the_optimiser_or_the_ema():
    networks, hyp = small_networks({'batch_size': 32})
    images, labels = torch.randn(6 * 32, 3, 32, 32), torch.randint(0, 10, (6 * 32,))
    with SyncLog() as log:
        torch.zeros(2).sum().item()                               # the log sees a sync ...
    assert log.syncs == 1
    with SyncLog() as log:                                        # ... and none in a whole epoch
        T.train_epoch(networks, images, labels, [0.5] * 6, hyp)
        networks.optimiser.step(0.5)
        T.ema_update(networks.ema_tensors, networks.trained_tensors, 0.9)
    assert log.syncs == 0


def test_gradients_are_freed_before_each_forward():
    """Step t's gradients must not be alive while step t+1's forward allocates its activations."""
    networks, hyp = small_networks({'batch_size': 32})
    alive = []
    networks.network.register_forward_pre_hook(
        lambda module, args: alive.append(any(p.grad is not None for p in module.parameters())))
    T.train_epoch(networks, torch.randn(3 * 32, 3, 32, 32), torch.randint(0, 10, (3 * 32,)), [0.5] * 3, hyp)
    assert alive == [False, False, False]
    assert all(p.grad is not None for p in networks.network.parameters() if p.requires_grad)   # the last step's


class ShapeLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the (shape, dtype) of every tensor an operation returns."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.shapes.add((tuple(t.shape), t.dtype))
        return out


def test_warm_up_makes_every_tensor_shape_of_a_run(dataset):
    """So that run 1 meets no allocation, no compiled shape and no cuDNN search the warm-up did
    not: every tensor a run makes (whitening patches, augmentation buffers, batches, evaluation
    batches) has its shape made in the warm-up too."""
    data = T.load_cifar10(T.ensure_cifar10(dataset))
    hyp = {**T.HYP, **T.TINY, 'epochs': 2, 'batch_size': 128, 'eval_batch_size': 64}   # 200 test images: 64 x 3 + 8
    with ShapeLog() as warm:
        networks = T.warmed_up_trainer(data, hyp, torch.device("cpu"), torch.float32, False, print)
    with ShapeLog() as run:
        T.train_run(data, T.upload_test_set(data, networks), networks, hyp, 0, lambda row: None)
    assert run.shapes <= warm.shapes, sorted(run.shapes - warm.shapes)
    assert ((1000, 3, 40, 40), torch.float32) in warm.shapes and ((8, 3, 32, 32), torch.float32) in warm.shapes


def test_optimiser_groups_lr_and_weight_decay():
    """Page's bias rule is the batch-norm biases': a layer added with a bias of its own (here a conv's,
    named 'bias' too) takes the weights' rate and decay."""
    model, hyp = small_model({'batch_size': 512})
    model.layer2[0] = torch.nn.Conv2d(8, 16, 3, padding=1, bias=True)
    weights, biases = T.optimiser(model, hyp).groups
    bn_biases = {id(m.bias) for m in model.modules() if isinstance(m, T.GhostBatchNorm)}
    assert {id(p) for p in biases['params']} == bn_biases
    convs = {id(m.weight) for m in model.modules() if isinstance(m, (T.WhitenedPrep, torch.nn.Conv2d, torch.nn.Linear))}
    assert {id(p) for p in weights['params']} == convs | {id(model.layer2[0].bias)}  # frozen BN scales left out
    assert weights['lr_scale'] == pytest.approx(1 / 512) and weights['weight_decay'] == pytest.approx(0.256)
    assert biases['lr_scale'] == pytest.approx(64 / 512) and biases['weight_decay'] == pytest.approx(0.004)
    _, off = T.optimiser(model, {**hyp, 'bias_lr_scale': 0.0}).groups   # 0: off, the weights' rate and decay
    assert off['lr_scale'] == weights['lr_scale'] and off['weight_decay'] == weights['weight_decay']


def test_optimiser_is_pages_nesterov_update_over_the_real_schedule():
    """Page's nesterov_update, written out in numpy float64: dw = -lr_t (g + wd w), v = m v + dw,
    w = w + dw + m v, with lr_t the schedule at step t / 97 of 10 epochs, times 1/512 for weights
    and 64/512 for batch-norm biases; 300 steps cover the warm-up, the peak and the decay."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, bias=False), torch.nn.BatchNorm2d(8)).double()
    model[1].weight.requires_grad_(False)
    with torch.no_grad():
        model[1].bias.normal_()
    opt = T.optimiser(model, {**T.HYP, 'batch_size': 512})
    hand = {'0.weight': [model[0].weight.detach().numpy().copy(), 1 / 512, 5e-4 * 512],
            '1.bias': [model[1].bias.detach().numpy().copy(), 64 / 512, 5e-4 * 512 / 64]}
    velocity = {name: 0.0 for name in hand}
    start = {name: w.copy() for name, (w, *_) in hand.items()}
    rng = np.random.default_rng(0)
    for t in range(1, 301):
        schedule = np.interp(t / 97, [0, 2, 8], [0, 1.0, 0.1])    # 0 -> 1 at epoch 2 -> 0.1 at epoch 8
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.grad = torch.from_numpy(rng.normal(0, 100, p.shape))
                w, lr_scale, wd = hand[name]
                dw = -schedule * lr_scale * (p.grad.numpy() + wd * w)
                velocity[name] = 0.9 * velocity[name] + dw
                hand[name][0] = w + dw + 0.9 * velocity[name]
        opt.step(T.lr_schedule({**T.HYP, 'epochs': 10}, t / 97))
    for name, p in model.named_parameters():
        if p.requires_grad:
            np.testing.assert_allclose(p.detach().numpy(), hand[name][0], rtol=1e-10, atol=1e-12)
            assert np.abs(hand[name][0] - start[name]).min() > 1e-3    # every value moved


def test_the_emas_small_steps_are_kept_in_fp32():
    """The EMA's 5 % step towards fp16 weights one fp16 unit away is a fraction of an fp16 unit,
    which an fp16 average would round away: the fp32 average moves by it."""
    model = torch.full((1000,), 1 + 2 ** -10, dtype=torch.float16)   # one fp16 unit above 1
    average = torch.ones(1000)
    T.ema_update([average], [model], 0.99 ** 5)
    expected = 1 + (1 - 0.99 ** 5) * 2 ** -10                     # 1.000048: a twentieth of a unit
    assert average.dtype == torch.float32
    torch.testing.assert_close(average.double(), torch.full((1000,), expected, dtype=torch.float64), rtol=1e-7, atol=0)
    half = torch.ones(1000, dtype=torch.float16)
    T.ema_update([half], [model], 0.99 ** 5)
    assert (half == 1).all()                                      # ... nothing, in fp16


def test_fp16_evaluation_of_the_fp32_ema_is_fp32s_up_to_fp16s_rounding(dataset):
    """The same fp32 EMA weights (a --tiny run's) evaluated in fp16, as on CUDA,
    and in fp32. fp16 stores each value rounded by up to u = 2^-11 of itself; along the network's
    depth a value is stored 37 times (the images; prep's conv, batch norm and CELU; for each of 7
    conv_bn blocks its weights, conv, batch norm and CELU; 2 residual sums; the head's weights and
    output; flip-TTA's sum), each rounding passes on at about its size (batch norm rescales a
    layer's error with its values), so the logits differ by at most 37 u of their norm. An image's
    answer can change only where its top two fp32 logits are closer than twice its largest change."""
    data = T.load_cifar10(dataset / T.BATCHES_DIR)
    hyp = {**T.HYP, **T.TINY}
    trained = T.Trainer(hyp, torch.device('cpu'), torch.float32, False)
    T.train_run(data, T.upload_test_set(data, trained), trained, hyp, 0, lambda row: None)
    labels = torch.from_numpy(data['test_labels'])
    logits, correct = {}, {}
    for dtype in (torch.float32, torch.float16):
        networks = T.Trainer(hyp, torch.device('cpu'), dtype, False)
        networks.ema.load_state_dict(trained.ema.state_dict())
        images = T.upload_normalised(data['test_images'], torch.device('cpu'), dtype)
        correct[dtype] = int(T.evaluate(networks, images, labels, hyp)[1])
        with torch.no_grad():                                     # the weights evaluate() cast
            logits[dtype] = T.flip_tta_logits(networks.eval_network, images)[1].double()
    exact, change = logits[torch.float32], logits[torch.float16] - logits[torch.float32]
    assert float(change.norm()) <= 37 * 2 ** -11 * float(exact.norm())
    top_two = exact.topk(2, dim=1).values
    may_change = int((top_two[:, 0] - top_two[:, 1] < 2 * change.abs().amax(1)).sum())
    assert abs(correct[torch.float16] - correct[torch.float32]) <= may_change
    assert correct[torch.float32] > 0.2 * len(labels)             # a network that tells classes apart


def constant_data(n_train=128, n_test=100, seed=0):
    """uint8 images of one value each (every crop, flip and mirror of one is itself), random labels."""
    rng = np.random.default_rng(seed)
    data = {}
    for split, n in (('train', n_train), ('test', n_test)):
        values = rng.integers(0, 256, n).astype(np.uint8)
        data[f'{split}_images'] = np.ascontiguousarray(np.broadcast_to(values[:, None, None, None], (n, 3, 32, 32)))
        data[f'{split}_labels'] = rng.integers(0, 10, n)
    return data


def give_known_logits(model):
    """model's logits become x_r (k - 4.5) for class k, x_r an image's normalised red value; its
    weights still get (zero) gradients, as the optimiser expects."""
    network = model.forward

    def forward(x):
        return x[:, :1, 0, 0].float() * (torch.arange(10) - 4.5) + 0 * network(x)
    model.forward = forward


def test_a_rows_losses_and_accuracies_are_the_label_smoothed_cross_entropy_by_hand():
    """train_loss and valid_loss are the label-smoothed cross-entropy (0.2) summed over the images and
    divided by their number, train_acc and valid_acc the share whose largest logit is the label:
    computed in numpy from known logits, against the row train_run makes."""
    networks, hyp = small_networks({'batch_size': 64, 'epochs': 1, 'whitening_images': 128, 'eval_batch_size': 64})
    give_known_logits(networks.network)
    give_known_logits(networks.eval_network)                         # the EMA's weights, evaluated
    data = constant_data()
    row, = T.train_run(data, T.upload_test_set(data, networks), networks, hyp, 0, lambda row: None)

    def by_hand(split):
        red = (data[f'{split}_images'][:, 0, 0, 0] - PAGE_MEAN[0]) / PAGE_STD[0]
        logits = red[:, None] * (np.arange(10) - 4.5)             # flip-TTA's mean of two equal logits
        log_p = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        labels = data[f'{split}_labels']
        eps = hyp['label_smoothing']                              # target: 1 - eps + eps/10 on the label, eps/10 elsewhere
        losses = -(1 - eps) * log_p[np.arange(len(labels)), labels] - eps * log_p.mean(1)
        return losses.mean(), np.mean(logits.argmax(1) == labels)
    # 2 steps of 64 take all 128 images. fp32: each image's loss (~2.5) rounds to a few 2^-24 of it,
    # their sum over 128 adds at most 128 x 2^-24 = 8e-6 of it
    for split, key in (('train', 'train'), ('test', 'valid')):
        loss, accuracy = by_hand(split)
        assert row[f'{key}_loss'] == pytest.approx(loss, rel=2e-5) and row[f'{key}_acc'] == accuracy


def test_total_time_is_preprocessing_plus_training_and_never_the_evaluation(monkeypatch):
    """The DAWNBench rule, on a clock the test moves: preprocessing (whitening) takes 10 s, each
    epoch's augmentation 0.5 s and training 1 s, each evaluation 100 s. The first epoch's images
    are made in the preprocessing, each later epoch's during the epoch before: after epoch e of 3,
    total time is 10.5 + 1.5 e, less the 0.5 s that the last epoch does not make."""
    now = [0.0]
    monkeypatch.setattr(T, 'time', types.SimpleNamespace(perf_counter=lambda: now[0]))

    def taking(seconds, function):
        def timed(*args, **kwargs):
            now[0] += seconds
            return function(*args, **kwargs)
        return timed
    for name, seconds in (('whitening_filters', 10.0), ('augmented_epoch', 0.5), ('train_epoch', 1.0),
                          ('evaluate', 100.0)):
        monkeypatch.setattr(T, name, taking(seconds, getattr(T, name)))
    networks, hyp = small_networks({'batch_size': 64, 'epochs': 3, 'whitening_images': 128})
    data = constant_data(n_test=10)
    rows = T.train_run(data, T.upload_test_set(data, networks), networks, hyp, 0, lambda row: None)
    assert [(r['train_time'], r['valid_time'], r['total_time']) for r in rows] == [
        (1.5, 100.0, 12.0), (1.5, 100.0, 13.5), (1.0, 100.0, 14.5)]


def test_a_run_with_cutout_zeroes_the_squares_it_drew_in_the_images_a_step_sees(monkeypatch):
    """cutout=8 in train_run: in each epoch, every image a step gets is zero (the mean colour) in all
    three channels on exactly the 8 x 8 square drawn for it, at its corner, and nowhere else (a
    normalised uint8 value is never 0: the means are not whole numbers)."""
    draws, seen = [], []
    draw, train_epoch = T.draw_augmentation, T.train_epoch
    monkeypatch.setattr(T, 'draw_augmentation', lambda *args: draws.append(draw(*args)) or draws[-1])
    monkeypatch.setattr(T, 'train_epoch', lambda networks, images, *args: seen.append(images.clone())
                        or train_epoch(networks, images, *args))
    networks, hyp = small_networks({'batch_size': 64, 'epochs': 2, 'whitening_images': 128, 'cutout': 8})
    data = dict(constant_data(n_test=10), train_images=np.random.default_rng(1).integers(0, 256, (128, 3, 32, 32),
                                                                                        dtype=np.uint8))
    T.train_run(data, T.upload_test_set(data, networks), networks, hyp, 0, lambda row: None)
    assert len(draws) == len(seen) == 2 and not torch.equal(draws[0][4], draws[1][4])
    for drawn, images in zip(draws, seen):
        for image, top, left in zip(images, drawn[4].tolist(), drawn[5].tolist()):  # each position's corner
            square = torch.zeros(32, 32, dtype=torch.bool)
            square[top:top + 8, left:left + 8] = True
            assert torch.equal((image == 0).all(0), square) and torch.equal((image == 0).any(0), square)


def test_t_quantile_matches_published_tables():
    for p, df, t in [(0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 9, 2.262), (0.975, 49, 2.010),
                     (0.975, 1000, 1.962), (0.95, 5, 2.015), (0.995, 20, 2.845), (0.8, 10, 0.879),
                     (0.9, 30, 1.310), (0.025, 9, -2.262), (0.5, 7, 0.0)]:
        assert T.t_quantile(p, df) == pytest.approx(t, abs=1e-3)


@pytest.mark.parametrize('t', [-1000.0, -12.706, -3.0, -0.5, 0.0, 0.7, 2.0, 30.0])
def test_t_cdf_equals_its_closed_forms_for_1_2_and_4_degrees_of_freedom(t):
    """df 1 is the Cauchy distribution; df 2 and 4 have closed forms too (u = t / sqrt(df + t^2))."""
    u2, u4 = t / math.sqrt(2 + t * t), t / math.sqrt(4 + t * t)
    for df, expected in [(1, 0.5 + math.atan(t) / math.pi), (2, 0.5 + u2 / 2), (4, 0.5 + 0.75 * (u4 - u4 ** 3 / 3))]:
        assert T.t_cdf(t, df) == pytest.approx(expected, rel=1e-9, abs=1e-15)
    # the tail is computed, not found as 1 - p: at t = -1000 and 1 degree of freedom it is 3.1831e-4
    assert T.t_cdf(-1000.0, 1) == pytest.approx(1 / (1000 * math.pi), rel=1e-6)
    # many degrees of freedom: the normal distribution's table, Phi(2) = 0.97725 (t at df 2e5 is
    # above it by 7e-7)
    assert T.t_cdf(2.0, 2e5) == pytest.approx(0.97725, abs=2e-6)


def test_welch_comparison_by_hand():
    """Equal spread, 3 runs a side: df = 2 (3 - 1) = 4, se = sqrt(2 x 1e-4 / 3), t = 0.02 / se =
    sqrt(6); the 95 % half width is 2.776 (the table's t at df 4) x se, and the p-value is
    2 (1 - F(sqrt 6)) with F(t) = 1/2 + 3/4 (u - u^3 / 3), u = t / sqrt(4 + t^2) = sqrt(0.6):
    p = 0.0705. Unequal spread and counts: va = 2e-4 / 2, vb = 2.5e-4 / 5, df = (va + vb)^2 /
    (va^2 / 1 + vb^2 / 4) = 2.25 / 1.0625."""
    w = T.welch(np.array([0.93, 0.94, 0.95]), np.array([0.95, 0.96, 0.97]))
    se = math.sqrt(2e-4 / 3)
    assert (w['diff'], w['se'], w['df']) == (pytest.approx(0.02), pytest.approx(se), pytest.approx(4))
    assert w['ci95'] == (pytest.approx(0.02 - 2.776 * se, abs=1e-5), pytest.approx(0.02 + 2.776 * se, abs=1e-5))
    u = math.sqrt(0.6)
    assert w['p'] == pytest.approx(2 * (0.5 - 0.75 * (u - u ** 3 / 3)), rel=1e-9)
    assert w['p'] == pytest.approx(0.0705, abs=1e-4)
    w = T.welch(np.array([0.90, 0.92]), np.array([0.93, 0.94, 0.95, 0.96, 0.97]))
    assert (w['diff'], w['df']) == (pytest.approx(0.04), pytest.approx(2.25 / 1.0625))


def finished_runs(accuracies, times=None):
    """Finished runs' records as summarize reads them: one epoch each, its accuracy (plain: 0.1 less)."""
    return [dict(failed=False, accuracy=a, time_s=t, rows=[dict(valid_acc=a, plain_acc=a - 0.1)])
            for a, t in zip(accuracies, times or [1.0] * len(accuracies))]


def test_summary_statistics_by_hand():
    runs = finished_runs([0.94, 0.93, 0.95], [3.0, 5.0, 4.0])
    runs.append(dict(failed=True, accuracy=float('nan'), time_s=1.0))
    s = T.summarize(runs)
    assert (s['runs'], s['finished'], s['failed']) == (4, 3, 1)
    assert s['acc_mean'] == pytest.approx(0.94) and s['acc_std'] == pytest.approx(0.01)
    half = 4.303 * 0.01 / math.sqrt(3)
    assert s['acc_ci95'][0] == pytest.approx(0.94 - half, abs=1e-5) and s['acc_ci95'][1] == pytest.approx(0.94 + half, abs=1e-5)
    assert (s['acc_min'], s['acc_median'], s['acc_max']) == (0.93, 0.94, 0.95)
    assert s['acc_no_tta_mean'] == pytest.approx(0.84) and s['acc_by_epoch'] == pytest.approx([0.94])
    assert not s['acc_ci95_clipped']
    assert (s['time_mean_s'], s['time_median_s'], s['time_max_s']) == (4.0, 4.0, 5.0)


def test_the_summary_of_one_run_says_what_it_has_in_plain_units():
    lines = T.summary_lines(T.summarize(finished_runs([0.384], [9.0])))
    assert lines == ['runs: 1 finished', 'accuracy (flip-TTA, EMA): mean 38.40 %, one run: no standard deviation',
                     'min / median / max: 38.40 / 38.40 / 38.40 %', 'without flip-TTA (each image alone): mean 28.40 %',
                     'mean by epoch: 38.40 %', 'time per run: mean 9.00 s, median 9.00 s, max 9.00 s']


def test_a_summary_gives_the_interval_clipped_to_0_100_where_its_runs_are_too_few(tmp_path):
    """Two runs at 52 and 61 %: the t interval is 56.5 +- 12.706 x 4.5 / sqrt(2) x sqrt(2) points, [-0.68,
    113.68] %: printed within 0-100 %, and said so; three runs close together need no clipping."""
    summary = T.summarize(finished_runs([0.52, 0.61]))
    half = 12.706205 * np.std([52, 61], ddof=1) / math.sqrt(2)
    assert np.multiply(summary['acc_ci95'], 100) == pytest.approx([0, 100]) and 56.5 + half > 100
    assert summary['acc_ci95_clipped'] and 56.5 - half < 0
    summary.update(trained=1, wall_s=2.0)
    lines = T.summary_lines(summary)
    assert '95% confidence interval of the mean: [0.00, 100.00] % (clipped to 0-100 %: too few runs)' in lines
    assert 'job: 1 run in 2.0 s of wall time after the warm-up, 1800 runs per hour' in lines
    lines = T.summary_lines(T.summarize(finished_runs([0.52, 0.53, 0.54])))
    assert '95% confidence interval of the mean: [50.52, 55.48] %' in lines       # 53 +- 4.303 x 1 / sqrt(3)


def test_run_log_summary_recomputes_from_its_own_rows():
    """run_log.txt, the unedited output of the mission's job, is whole, and its summary is what the
    script's own summary code (summarize, summary_lines) makes of the last rows of its runs' tables:
    every figure of each line, to one unit of its last printed place (the rows round accuracies to
    0.005 % and times to 0.00005 s, less than half a unit; the log's figures and ours each round to
    half a unit: they may differ by one)."""
    log = (SCRIPT.parent / 'run_log.txt').read_text()
    epochs = int(re.search(r'epochs=(\d+)', log)[1])
    tables = re.findall(r'^run (\d+)/(\d+) .*\n.*\n((?: +\d+ .*\n)+)', log, re.M)
    assert [int(run) for run, _, _ in tables] == list(range(1, int(tables[0][1]) + 1))
    assert all(len(rows.splitlines()) == epochs for _, _, rows in tables)
    keys = [column.replace(' ', '_') for column in T.COLUMNS]       # a row's, in the table's order
    runs = []
    for run, _, table in tables:
        rows = [dict(zip(keys, map(float, line.split()))) for line in table.splitlines()]
        runs.append(dict(run=int(run), failed=False, rows=rows, accuracy=rows[-1]['valid_acc'],
                         time_s=rows[-1]['total_time']))
    ours = T.summary_lines(T.summarize(runs, hyp={**T.HYP, 'flip_tta': False}))  # no plain_acc in a log
    printed = log[log.index(f'runs: {len(runs)} finished\n'):].splitlines()

    def figures(lines, start):  # the numbers of the line that starts so, and a unit of their last places
        line = next(line for line in lines if line.startswith(start))
        return ([float(x) for x in re.findall(r'\d+(?:\.\d+)?', line)],
                [10.0 ** -len(decimals) if decimals else 0 for decimals in re.findall(r'\d+(?:\.(\d+))?', line)])
    for start in ('runs:', 'accuracy', '95%', 'min / median', 'time per run'):
        (expected, units), (got, _) = figures(printed, start), figures(ours, start)
        # the log may print more figures a line (an older version's: runs >= 94%), not fewer
        assert len(got) <= len(expected) and all(abs(g - e) <= 1.01 * unit for g, e, unit in zip(got, expected, units)), (
            start, got, expected)


def header_context(hyp, **changes):
    """A job's identity as Job.set_up makes it, for header_lines."""
    return {**dict(script_sha256='0123456789abcdef', torch=torch.__version__, device='CPU', dtype='torch.float32',
                   seed=0, train_images=3000, test_images=500, hyperparameters=hyp, data='x',
                   data_digest='d'), **changes}


def test_hyperparameters_are_printed_in_lines_a_terminal_shows_whole():
    hyp = {**T.HYP, **T.TINY}
    header = T.header_lines(header_context(hyp))
    lines = [line for line in header if 'hyperparameters' in line or line.startswith('    ')]
    assert all(len(line) <= 100 for line in lines) and len(lines) > 1
    printed = re.sub(r'\s+', ' ', ' '.join(lines).replace('hyperparameters: ', ''))
    assert printed == ', '.join(f'{k}={v}' for k, v in hyp.items())    # every item, once, in order
    assert 'whitening_images=3000' in printed                     # --tiny whitens its 3,000 images


def test_help_gives_examples_no_empty_defaults_and_each_tricks_switch(capsys, monkeypatch):
    """A learner's first stop: --help gives every default and the setting that turns off each of
    Page's tricks."""
    assert T.main(['--help']) == 0
    out = capsys.readouterr().out
    assert '(default: None)' not in out and '(default: False)' not in out
    assert '(default: 512, --tiny 64)' in out and '(default: 0)' in out   # a written default, a default of 0
    assert 'examples:' in out and '--resume a.json' in out and '--compare a.json b.json' in out
    options = out.split('options:')[1].split('examples:')[0]
    assert len(options.splitlines()) <= 55          # a short line an option and --set's defaults: README has more
    listed = ' '.join(options.split('--set NAME=VALUE [NAME=VALUE ...]')[1].split('\n  --seed')[0].split())
    defaults = listed.split(' are ')[1].split(' (TINY')[0].split()
    assert defaults == [f'{name}={T.as_typed(value)}' for name, value in T.HYP.items()]   # each, in order
    assert 'channels=64,128,256,512' in defaults and 'logit_scale=0.0625' in defaults
    tricks = listed.split("Page's tricks")[1]
    assert all(f'({name}={value})' in tricks for name, value in ALL_TRICKS_OFF.items())
    monkeypatch.setattr(T, '__doc__', None)                         # python -OO strips docstrings
    assert T.main(['--help']) == 0 and '--epochs N' in capsys.readouterr().out


def test_table_columns_are_twelve_characters_wide():
    line = T.table_line(T.COLUMNS)
    assert len(line) == 12 * 9 and line[:12] == '       epoch' and line.endswith('  total time')
    row = T.table_line(dict(epoch=3, lr=0.1, train_time=2.5, train_loss=1.23456, train_acc=0.5,
                            valid_time=0.25, valid_loss=1.0, valid_acc=0.9412, total_time=7.75).values())
    assert row == ''.join(f'{s:>12}' for s in
                          ['3', '0.1000', '2.5000', '1.2346', '0.5000', '0.2500', '1.0000', '0.9412', '7.7500'])


# ---------------------------------------------------------------------------------------------
# Data: safe loading, download, checks
# ---------------------------------------------------------------------------------------------
def test_generated_and_protocol_2_pickles_load_with_their_labels(tmp_path):
    folder = write_dataset(tmp_path, per_batch=30, n_test=20, seed=3)
    data = T.load_cifar10(folder)
    assert data['train_images'].shape == (150, 3, 32, 32) and data['train_images'].dtype == np.uint8
    raw = pickle.loads((folder / 'data_batch_2').read_bytes())
    np.testing.assert_array_equal(data['train_labels'][30:60], raw['labels'])
    np.testing.assert_array_equal(data['train_images'][30:60].reshape(30, -1), raw['data'])
    assert data['provenance'].startswith('NOT the official CIFAR-10')


class RunsCode:
    """Pickled, it runs a shell command when it is loaded: touch marker."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


def test_a_batch_file_whose_pickle_would_run_code_is_refused_in_one_line_and_runs_nothing(tmp_path):
    folder = write_dataset(tmp_path, per_batch=20, n_test=20)
    marker = tmp_path / 'ran'
    batch = {'batch_label': 'x', 'labels': [0] * 20, 'data': RunsCode(marker), 'filenames': []}
    (folder / 'data_batch_2').write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(T.UserError) as refusal:
        T.load_cifar10(folder)
    assert re.search(r'data_batch_2: not a CIFAR-10 python batch \(UnpicklingError: it asks for \w+\.system, which '
                     r'no batch file needs\)', str(refusal.value)) and '\n' not in str(refusal.value)
    assert not marker.exists()
    pickle.loads((folder / 'data_batch_2').read_bytes())         # the file does run code, unrestricted
    assert marker.exists()


@pytest.mark.parametrize('damage, message', [
    (lambda p: p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2]), r'not a CIFAR-10 python batch \(UnpicklingError'),
    (lambda p: p.write_bytes(b'\x00' * 100), r'not a CIFAR-10 python batch \(UnpicklingError'),
    (lambda p: p.unlink(), r'data_batch_3: not a CIFAR-10 python batch \(No such file or directory\): .* must hold a '
                           r'whole copy \(a --data-dir without one gets a download\)$'),
    (lambda p: write_batch(p, np.zeros((5, 3, 32, 31), np.uint8), [0] * 5, 'x'), 'ValueError: cannot reshape array'),
    (lambda p: write_batch(p, np.zeros((5, 3, 32, 32), np.uint8), [0, 1, 2, 3, 10], 'x'), 'labels from 0 to 10, not '
                                                                                           'within 0-9'),
    (lambda p: write_batch(p, np.zeros((5, 3, 32, 32), np.uint8), [0] * 4, 'x'), 'not 5 integer labels but int64 \\(4,\\)'),
])
def test_damaged_batch_files_are_refused(tmp_path, damage, message):
    folder = write_dataset(tmp_path, per_batch=20, n_test=20)
    damage(folder / 'data_batch_3')
    with pytest.raises(T.UserError, match=message):
        T.load_cifar10(folder)


def make_archive(tmp_path):
    """A gzip tarball of a generated dataset, as the official archive is laid out; (bytes, md5)."""
    source = tmp_path / 'source'
    write_dataset(source, per_batch=20, n_test=20)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode='w:gz') as tar:
        tar.add(source / T.BATCHES_DIR, arcname=T.BATCHES_DIR)
    archive = buffer.getvalue()
    return archive, hashlib.md5(archive).hexdigest()


@pytest.fixture
def server():
    """A file server on loopback that logs the paths asked for, and sends only the first
    options['cut'] bytes of a body before dropping the connection while options['cut'] is set."""
    files, hits, options = {}, [], {'cut': None}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header('Content-Length', str(len(body)))
            self.end_headers()
            self.wfile.write(body[:options['cut']])

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f'http://127.0.0.1:{httpd.server_address[1]}', files, hits, options
    httpd.shutdown()


def leftovers(data_dir):
    return sorted(p.name for p in Path(data_dir).iterdir())


def test_download_checks_md5_extracts_and_never_downloads_again(tmp_path, server):
    url, files, hits, _ = server
    archive, md5 = make_archive(tmp_path)
    files['/cifar-10-python.tar.gz'] = archive
    data_dir = tmp_path / 'data'
    folder = T.ensure_cifar10(data_dir, url + '/cifar-10-python.tar.gz', md5)
    assert leftovers(data_dir) == ['cifar-10-batches-py', 'cifar-10-python.tar.gz']
    assert len(T.load_cifar10(folder)['train_labels']) == 100
    assert T.ensure_cifar10(data_dir, url + '/cifar-10-python.tar.gz', md5) == folder
    shutil.rmtree(data_dir / T.BATCHES_DIR)
    T.ensure_cifar10(data_dir, url + '/cifar-10-python.tar.gz', md5)  # extracts the kept archive
    assert len(hits) == 1


def test_wrong_checksum_is_refused_and_nothing_is_kept(tmp_path, server):
    url, files, _, _ = server
    archive, _ = make_archive(tmp_path)
    files['/a.tar.gz'] = archive
    data_dir = tmp_path / 'data'
    with pytest.raises(T.UserError, match='md5'):
        T.ensure_cifar10(data_dir, url + '/a.tar.gz', '0' * 32)
    assert leftovers(data_dir) == []                              # no archive, no part


def test_corrupt_archive_is_refused_and_nothing_is_extracted(tmp_path, monkeypatch):
    archive, _ = make_archive(tmp_path)
    truncated = archive[:len(archive) // 2]
    (tmp_path / 'cut.tar.gz').write_bytes(truncated)
    data_dir = tmp_path / 'data'
    with pytest.raises(T.UserError, match='nor from .*: put cifar-10-batches-py/ there yourself, or delete a '
                                          'damaged cifar-10-python.tar.gz there$'):
        T.ensure_cifar10(data_dir, (tmp_path / 'cut.tar.gz').as_uri(), hashlib.md5(truncated).hexdigest())
    assert leftovers(data_dir) == ['cifar-10-python.tar.gz']          # no batches, no staging folder
    monkeypatch.setattr(tempfile, 'mkdtemp', lambda *args: (_ for _ in ()).throw(
        PermissionError(errno.EACCES, 'Permission denied')))        # a read-only folder, as root is not
    with pytest.raises(T.UserError, match=r'nor from .*Permission denied'):
        T.ensure_cifar10(data_dir)                                # extracts the archive there
    monkeypatch.undo()
    (tmp_path / 'garbage.tar.gz').write_bytes(gzip.compress(b'not a tar file' * 100))
    with pytest.raises(T.UserError, match='nor from .*: put cifar-10-batches-py/ there yourself'):
        T.ensure_cifar10(tmp_path / 'data2', (tmp_path / 'garbage.tar.gz').as_uri(),
                         hashlib.md5((tmp_path / 'garbage.tar.gz').read_bytes()).hexdigest())


def test_no_network_gives_one_clear_error_and_leaves_nothing(tmp_path, server):
    url, files, _, _ = server
    with pytest.raises(T.UserError, match='nor from .*Not Found'):
        T.ensure_cifar10(tmp_path / 'data', url + '/missing.tar.gz')
    with pytest.raises(T.UserError) as refused:   # a mistyped path, offline: the likelier cause comes first
        T.ensure_cifar10(tmp_path / 'a' / 'b', 'http://127.0.0.1:9/cifar-10-python.tar.gz')  # refused
    assert re.match(r'no CIFAR-10 in --data-dir .*a/b \(is that path right\?\), nor from '
                    r'http://127\.0\.0\.1:9/', str(refused.value))
    assert leftovers(tmp_path / 'a' / 'b') == []                  # no archive, no part
    for malformed in ('mirror.example.com/cifar-10-python.tar.gz', ''):   # no scheme; nothing
        with pytest.raises(T.UserError, match='nor from'):
            T.ensure_cifar10(tmp_path / 'data', malformed)
    if Path('/dev/full').exists():                                # a full disk is not the network's fault
        files['/cifar-10-python.tar.gz'] = b'x' * (2 << 20)
        (tmp_path / 'data' / '.cifar-10-python.tar.gz.part').symlink_to('/dev/full')
        with pytest.raises(T.UserError, match=r'nor from .*No space left on device'):
            T.ensure_cifar10(tmp_path / 'data', url + '/cifar-10-python.tar.gz')
        assert leftovers(tmp_path / 'data') == []


def test_a_cut_download_is_never_taken_for_a_whole_one(tmp_path, server):
    url, files, hits, options = server
    archive, md5 = make_archive(tmp_path)
    files['/cifar-10-python.tar.gz'] = archive
    options['cut'] = len(archive) // 2                            # the connection drops half-way
    data_dir = tmp_path / 'data'
    data_dir.mkdir()
    with pytest.raises(T.UserError, match='its md5 is .* it is cut short or not the CIFAR-10 archive'):
        T.ensure_cifar10(data_dir, url + '/cifar-10-python.tar.gz', md5)
    assert leftovers(data_dir) == []
    options['cut'] = None
    folder = T.ensure_cifar10(data_dir, url + '/cifar-10-python.tar.gz', md5)
    assert leftovers(data_dir) == ['cifar-10-batches-py', 'cifar-10-python.tar.gz']
    assert len(T.load_cifar10(folder)['train_labels']) == 100 and len(hits) == 2


def test_a_mirror_is_used_and_still_checked_against_the_official_md5(tmp_path, server, monkeypatch, capsys):
    url, files, hits, _ = server
    archive, md5 = make_archive(tmp_path)
    files['/mirror/cifar-10-python.tar.gz'] = archive
    # a mirror serving anything but the official archive is refused, and nothing is kept
    monkeypatch.setenv('CIFAR10_URL', url + '/mirror/cifar-10-python.tar.gz')   # a notebook's os.environ too
    assert T.main(['--tiny', '--data-dir', str(tmp_path / 'data')]) == 1
    assert f'not {T.CIFAR10_MD5}' in capsys.readouterr().err and leftovers(tmp_path / 'data') == []
    monkeypatch.setattr(T, 'ensure_cifar10', partial(T.ensure_cifar10, md5=md5))   # as if the archive were official
    assert T.main(['--tiny', '--epochs', '1', '--batch-size', '32', '--data-dir', str(tmp_path / 'data')]) == 0
    assert len(hits) == 2 and (tmp_path / 'data' / T.BATCHES_DIR).is_dir()


def test_the_batches_folder_itself_works_as_data_dir_and_a_file_is_refused(tmp_path):
    folder = write_dataset(tmp_path, per_batch=20, n_test=20)
    assert T.ensure_cifar10(folder) == folder                     # what torchvision users point at
    assert T.ensure_cifar10(tmp_path) == folder
    with pytest.raises(T.UserError, match=r'is that path right.*File exists'):
        T.ensure_cifar10(folder / 'data_batch_1')


@pytest.mark.parametrize('args, message', [
    (['--epochs', '0'], '--set epochs=0: must be a finite number of at least 1'),
    (['--batch-size', '48'], "--set batch_size=48: must be a multiple of ghost batch norm's split, 32"),
    (['--batch-size', '2048'], 'batch_size=2048: more than the 1000 training images'),
    (['--device', 'tpu'], '--device tpu: torch cannot train on it here ('),
    (['--device', 'cuda'], '--device cuda: torch cannot train on it here ('),
])
def test_bad_options_get_one_line_and_a_nonzero_exit(dataset, args, message, capsys):
    if args == ['--device', 'cuda'] and torch.cuda.is_available():
        pytest.skip('this machine has a GPU')
    assert T.main(['--tiny', '--data-dir', str(dataset), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith('error: ') and '\n' not in err


def test_unwritable_data_dir_is_refused(tmp_path, capsys):
    (tmp_path / 'a_file').write_text('')
    assert T.main(['--tiny', '--data-dir', str(tmp_path / 'a_file' / 'data')]) == 1
    assert re.search(r'data \(is that path right\?\), nor from .*Not a directory', capsys.readouterr().err)


def test_auto_takes_the_accelerator_and_probes_it(monkeypatch):
    """Each device is probed (torch.empty), here by a stand-in that makes the CPU take a GPU for a real one."""
    monkeypatch.setattr(torch.accelerator, 'current_accelerator', lambda check_available: torch.device('cuda'))
    probed = []
    monkeypatch.setattr(torch, 'empty', lambda size, device: probed.append(device))
    assert T.pick_device('auto') == torch.device('cuda') and T.pick_device('cpu') == torch.device('cpu')
    assert probed == [torch.device('cuda'), torch.device('cpu')]


@pytest.mark.parametrize('name', ['tpu', 'cuda:x', 'cuda:7', 'mps'])
def test_a_device_torch_cannot_use_is_refused_in_one_line_with_torchs_reason(name):
    if name != 'tpu' and torch.device(name.replace(':x', '')).type == 'cuda' and torch.cuda.device_count() > 7:
        pytest.skip('this machine has that GPU')
    if name == 'mps' and torch.backends.mps.is_available():
        pytest.skip('this machine has MPS')
    with pytest.raises(T.UserError) as refusal:
        T.pick_device(name)
    message = str(refusal.value)
    assert message.startswith(f'--device {name}: torch cannot train on it here (') and '\n' not in message
    assert message.endswith('); choose auto, cuda, cuda:N, mps or cpu') and '()' not in message


@pytest.mark.parametrize('device', ['cpu', 'cuda', 'mps'])
@pytest.mark.parametrize('tiny', [False, True])
@pytest.mark.parametrize('option', [None, True, False])
def test_compilation_and_layout_for_each_device_size_and_option(monkeypatch, device, tiny, option):
    """Compile by default on cuda and cpu, never for --tiny (compiling takes longer than all of it)
    nor on mps (experimental); --compile / --no-compile win. On cuda as CUDA graphs. channels_last
    compiled, but on mps: eager steps are NCHW."""
    args = T.parse_args(['--tiny'] * tiny + {None: [], True: ['--compile'], False: ['--no-compile']}[option])
    compile = T.pick_compile_mode(args.compile, torch.device(device), args.tiny)
    on = option if option is not None else device in ('cuda', 'cpu') and not tiny
    assert compile == (on and ('reduce-overhead' if device == 'cuda' else 'default'))
    modes = []
    monkeypatch.setattr(T.torch, 'compile', lambda function, **options: modes.append(options['mode']) or function)
    layout = T.Trainer({**T.HYP, **T.TINY}, torch.device('cpu'), torch.float32, compile).memory_format
    assert modes == ([compile] * 2 if on else [])                 # the training step and flip-TTA
    if device != 'mps':                                          # an mps device cannot be built here
        assert layout == (torch.channels_last if compile else torch.contiguous_format)


def replayed_as_cuda_graphs(function, **options):
    """torch.compile as CUDA graphs return outputs: each call's outputs live in the graph's memory,
    which its next call (replay) overwrites; here they become NaN, so a stale read shows."""
    outputs = []
    def replay(*args):
        with torch.no_grad():
            for t in outputs:
                t.fill_(math.nan)
        outputs[:] = function(*args)
        return tuple(outputs)
    return replay


def test_a_job_compiled_for_cuda_graphs_says_how_often_inductor_skipped_them(compiled_runs, dataset, monkeypatch, capsys):
    """Inductor runs a compiled pass without CUDA graphs, unasked, where they cannot hold it. A job
    compiled for them gives inductor's count of such skips after its warm-up. On the CPU (the fp16
    worker, compiled as on a GPU) it skips them once per pass: the step's and the evaluation's. A
    compile that skips none counts 0; a compile without CUDA graphs says nothing of them."""
    said = torch.load(compiled_runs['float16'][0] / 'run.pt')['said']
    assert said[0].startswith('torch.compile (reduce-overhead): ')
    assert said[1:] == ["CUDA graphs: inductor's count of skips in the warm-up is 2 (TORCH_LOGS=cudagraphs names each)"]
    monkeypatch.setattr(T.torch, 'compile', replayed_as_cuda_graphs)
    for mode in ('reduce-overhead', 'default'):
        monkeypatch.setattr(T, 'pick_compile_mode', lambda *args: mode)
        assert T.main(['--tiny', '--epochs', '1', '--data-dir', str(dataset)]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines() if 'CUDA graphs' in line]
        if mode == 'reduce-overhead':
            assert lines == ["CUDA graphs: inductor's count of skips in the warm-up is 0 (TORCH_LOGS=cudagraphs names each)"]
        else:
            assert lines == []


def test_no_output_of_a_compiled_call_is_read_after_the_next_call(monkeypatch, dataset):
    """CUDA graphs overwrite a call's outputs at the next call (a replay): a run whose loss,
    logits and flip-TTA logits go stale then is the same run, row for row."""
    data = T.load_cifar10(dataset / T.BATCHES_DIR)
    hyp = {**T.HYP, **T.TINY, 'epochs': 2, 'eval_batch_size': 64}   # 4 steps and 4 test batches
    data = {k: v[:256] if k.startswith('train') else v for k, v in data.items()}
    runs = []
    for compile in (lambda function, **options: function, replayed_as_cuda_graphs):
        monkeypatch.setattr(T.torch, 'compile', compile)
        networks = T.Trainer(hyp, torch.device('cpu'), torch.float32, 'reduce-overhead')
        runs.append(T.train_run(data, T.upload_test_set(data, networks), networks, hyp, 0, lambda row: None))
    times = ('train_time', 'valid_time', 'total_time')
    assert [{k: v for k, v in row.items() if k not in times} for row in runs[1]] == [
        {k: v for k, v in row.items() if k not in times} for row in runs[0]]
    assert all(math.isfinite(row['train_loss']) and row['valid_acc'] > 0.1 for row in runs[0])


@pytest.fixture
def tf32_allowed():
    """cuDNN's default, TF32 allowed, for one test, and the flags as they were after it. Not
    monkeypatch: torch serves cuBLAS's flag through __getattr__, which pytest 9.2's undo deletes."""
    flags = (torch.backends.cudnn, torch.backends.cuda.matmul)
    saved = [backend.allow_tf32 for backend in flags]
    for backend in flags:
        backend.allow_tf32 = True
    yield
    for backend, value in zip(flags, saved):
        backend.allow_tf32 = value


def test_a_job_turns_tf32_off_and_says_it_evaluates_in_its_dtype(dataset, tmp_path, monkeypatch, capsys,
                                                                 tf32_allowed):
    """TF32 rounds fp32 products to fp16's 10 mantissa bits: a job's runs have it off (cuDNN allows it by
    default), so that fp32 is fp32 on every GPU, and main() leaves it as it was. The header and the job
    file say the evaluation's dtype."""
    flags, train_run = [], T.train_run
    monkeypatch.setattr(T, 'train_run', lambda *args, **kwargs: flags.append(
        (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)) or train_run(*args, **kwargs))
    path = tmp_path / 'r.json'
    assert T.main([*SMALL_RUN, '--data-dir', str(dataset), '--json', str(path)]) == 0
    assert flags and set(flags) == {(False, False)}                # the warm-up's runs and the job's
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    assert ('dtype float32 (batch norm and the loss fp32; no TF32), in training and evaluation'
            in capsys.readouterr().out)


class DtypeLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtypes of the tensors each convolution, batch norm, matrix product and log-softmax reads."""

    def __init__(self):
        super().__init__()
        self.seen = collections.defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).removeprefix('aten.')
        if name in ('convolution', 'addmm', 'mm', '_native_batch_norm_legit_no_training',
                    'native_batch_norm', '_log_softmax'):
            self.seen[name].update(str(a.dtype).removeprefix('torch.') for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('dtype', [torch.float16, torch.float32])
def test_evaluation_runs_in_the_networks_dtype_with_batch_norm_and_the_loss_in_fp32(dtype):
    """As the network trains, it is evaluated: convolutions and the head in its dtype, batch norm's
    statistics and the loss in fp32 (the whitened prep conv, fp32, reads the images in the dtype)."""
    networks, hyp = small_networks(dtype=dtype)
    images = torch.randn(20, 3, 32, 32).to(dtype)
    with DtypeLog() as log:
        T.evaluate(networks, images, torch.arange(20) % 10, {**hyp, 'eval_batch_size': 10})
    name = str(dtype).removeprefix('torch.')
    assert log.seen['convolution'] == {name, 'float32'}                       # the prep conv: fp32
    assert log.seen['mm'] | log.seen['addmm'] == {name, 'float32'}            # the head; the prep's fold
    batch_norm = log.seen['native_batch_norm'] | log.seen['_native_batch_norm_legit_no_training']
    assert batch_norm == {'float32'}                                          # its input cast too
    assert log.seen['_log_softmax'] == {'float32'}


# A whole --tiny run in 4 steps of 64 images and 100 test images: seconds on a 2-core CPU
SMALL_RUN = ['--tiny', '--epochs', '1', '--device', 'cpu', '--set', 'train_images=256', 'test_images=100']


@pytest.mark.parametrize('option, dtype', [('fp16', torch.float16)])
def test_half_precision_from_the_command_line_trains_a_whole_run(dataset, tmp_path, monkeypatch, capsys, option, dtype):
    """--dtype fp16 through main on the CPU: the header and the job file name the dtype, the network
    trains with weights in it, and the run's rows are finite."""
    trained_in, train_epoch = set(), T.train_epoch
    monkeypatch.setattr(T, 'train_epoch', lambda networks, *args: trained_in.update(
        p.dtype for p in networks.network.parameters()) or train_epoch(networks, *args))
    path = tmp_path / 'r.json'
    assert T.main([*SMALL_RUN, '--dtype', option, '--data-dir', str(dataset), '--json', str(path)]) == 0
    name = str(dtype).replace('torch.', '')
    assert any(re.match(rf'dtype {name}\b', line) for line in capsys.readouterr().out.splitlines())
    job = T.read_job(path, '--json')
    assert job['dtype'] == str(dtype) and dtype in trained_in  # BN: fp32
    run, = job['runs']
    assert not run['failed'] and all(math.isfinite(v) for row in run['rows'] for v in row.values())


# ---------------------------------------------------------------------------------------------
# Page's tricks, each with the setting that turns it off (README's table, HYP's comments)
# ---------------------------------------------------------------------------------------------
ALL_TRICKS_OFF = dict(label_smoothing=0, celu_alpha=0, bn_split_size=0, bn_scale_frozen=False, whitening='none',
                      ema_momentum=0, flip_tta=False)


def test_hyps_comments_and_the_readme_name_each_tricks_off_switch():
    """The recipe's reader finds each switch beside its setting (the comment of its line in HYP) and
    the README's user in the table of tricks."""
    source = inspect.getsource(T).split('HYP = dict(')[1].split('\n)')[0]
    comments = {line.split('=')[0].strip(): line.split('#')[1] for line in source.splitlines() if '#' in line}
    readme = (SCRIPT.parent / 'README.md').read_text()
    for name, value in ALL_TRICKS_OFF.items():
        assert re.search(rf"\('?{value}'? ", comments[name]), name
        assert f'`{name}={value}`' in readme, name


@pytest.mark.parametrize('name, value', [*ALL_TRICKS_OFF.items(), ('whitening', 'learned')])
def test_a_trick_off_changes_its_own_layers_and_every_other_weight_is_drawn_as_before(name, value):
    """Same seed, same whitening: the network without the trick draws every weight the recipe's
    draws, bit for bit, but those of the layers the trick is (a plain 3x3 conv in place of the
    whitened prep draws as many numbers, so every later layer draws the same)."""
    whitening = torch.randn(27, 3, 3, 3)
    recipe, _ = small_model(whitening=whitening)
    changed, _ = small_model({name: value}, whitening=whitening)
    before, after = recipe.state_dict(), changed.state_dict()
    own = {'whitening': {'prep.0.whitening', 'prep.0.weight'}}.get(name, set()) if value == 'none' else set()
    assert set(after) == set(before) - ({'prep.0.whitening'} if own else set())
    assert [k for k in after if k not in own and not torch.equal(after[k], before[k])] == []
    activations = [type(m) for m in changed.modules() if isinstance(m, (torch.nn.CELU, torch.nn.ReLU))]
    assert activations == [torch.nn.ReLU if name == 'celu_alpha' else torch.nn.CELU] * 8
    norms = [m for m in changed.modules() if isinstance(m, T.GhostBatchNorm)]
    assert {m.split_size for m in norms} == {0 if name == 'bn_split_size' else 32}
    assert {m.weight.requires_grad for m in norms} == {name == 'bn_scale_frozen'}      # False: learned
    prep = changed.prep[0]
    if name == 'whitening' and value == 'none':
        assert type(prep) is torch.nn.Conv2d and prep.weight.shape == (8, 3, 3, 3) and prep.bias is None
    else:                                     # learned: a weight the optimiser trains, with the others
        assert isinstance(prep.whitening, torch.nn.Parameter) == (value == 'learned')
        weights, _ = T.optimiser(changed, {**T.HYP, name: value}).groups
        assert any(p is prep.whitening for p in weights['params']) == (value == 'learned')
    learned_scales = {id(m.weight) for m in norms if m.weight.requires_grad}
    assert learned_scales <= {id(p) for p in T.optimiser(changed, T.HYP).groups[0]['params']}


@pytest.mark.parametrize('layout', [torch.contiguous_format, torch.channels_last])
def test_ghost_batch_norm_off_is_batch_norm_over_the_whole_batch(layout):
    """bn_split_size=0, eager (NCHW) and compiled's path (channels_last): the output and the running
    statistics of torch's batch norm over all 64 images (unbiased variance: 64 x 36 / (64 x 36 - 1))."""
    torch.manual_seed(0)
    x = (torch.randn(64, 4, 6, 6) * 3 + 1).double()
    bn, plain = T.GhostBatchNorm(4, split_size=0).double(), torch.nn.BatchNorm2d(4).double()
    bn.bias.data = plain.bias.data = torch.randn(4, dtype=torch.double)
    torch.testing.assert_close(bn(x.contiguous(memory_format=layout)), plain(x))
    torch.testing.assert_close(bn.running_mean, 0.1 * x.mean((0, 2, 3)))
    torch.testing.assert_close(bn.running_var, 0.9 + 0.1 * x.var((0, 2, 3), correction=1))


def test_no_ema_and_no_tta_evaluate_the_trained_weights_on_each_image_alone():
    """ema_momentum=0 and flip_tta=False: the evaluated model is the trained network after its last
    step (in eval mode), its logits on each image alone; with TTA, the plain count is still that."""
    for flip_tta in (False, True):
        networks, hyp = small_networks({'batch_size': 32, 'ema_momentum': 0.0, 'flip_tta': flip_tta})
        images, labels = torch.randn(3 * 32, 3, 32, 32), torch.randint(0, 10, (3 * 32,))
        T.train_epoch(networks, images, labels, [0.5] * 3, hyp)
        trained = copy.deepcopy(networks.network).eval()
        test, test_labels = torch.randn(40, 3, 32, 32), torch.randint(0, 10, (40,))
        with torch.no_grad():
            plain = trained(test)
            tta = (plain + trained(test.flip(3))) / 2
        loss, correct, plain_correct = T.evaluate(networks, test, test_labels, {**hyp, 'eval_batch_size': 16})
        logits = tta if flip_tta else plain
        torch.testing.assert_close(loss, F.cross_entropy(logits, test_labels, label_smoothing=0.2, reduction='sum'))
        assert int(correct) == int((logits.argmax(1) == test_labels).sum())
        assert int(plain_correct) == int((plain.argmax(1) == test_labels).sum())


def test_label_smoothing_off_is_plain_cross_entropy():
    """The summed loss by hand from the log-softmax: -log p_y, and with smoothing s the mean over
    classes takes s of it: (1 - s) (-log p_y) + s mean_c(-log p_c)."""
    model, hyp = small_model()
    model.eval()                                     # the same logits twice: running statistics fixed
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    logp = torch.log_softmax(model(x).double(), 1).detach()
    for smoothing in (0.0, 0.2):
        expected = ((1 - smoothing) * -logp[torch.arange(8), y] + smoothing * -logp.mean(1)).sum()
        assert T.summed_loss(model, x, y, smoothing)[0].item() == pytest.approx(float(expected), rel=1e-5)


def test_the_header_and_summary_say_what_valid_accuracy_is_of():
    hyp = {**T.HYP, **T.TINY}
    header = T.header_lines(header_context(hyp))
    assert 'valid = accuracy (flip-TTA, EMA) and label-smoothed loss; total time' in header[-1]
    header = T.header_lines(header_context({**hyp, **ALL_TRICKS_OFF}))
    assert header[-1].startswith('valid = accuracy (no TTA, no EMA: the trained weights) and label-smoothed')
    runs = [dict(run=i, seed=i, failed=False, accuracy=acc, time_s=1.0,
                 rows=[dict(valid_acc=acc, plain_acc=plain)]) for i, (acc, plain) in enumerate([(0.5, 0.4), (0.7, 0.5)])]
    lines = T.summary_lines(T.summarize(runs, hyp=hyp))
    assert 'accuracy (flip-TTA, EMA): mean 60.00 %, standard deviation 14.14 %' in lines
    assert 'without flip-TTA (each image alone): mean 45.00 %' in lines               # (40 + 50) / 2
    lines = T.summary_lines(T.summarize(runs, hyp={**hyp, 'flip_tta': False, 'ema_momentum': 0}))
    assert lines[1].startswith('accuracy (no TTA, no EMA: the trained weights): mean 60.00 %')
    assert not any('without flip-TTA' in line for line in lines)


def test_every_trick_off_trains_through_main(dataset, tmp_path, capsys):
    """One --tiny epoch with all seven off, the whitening learned in another: each finishes with finite
    rows, the header and the job file say what was run."""
    for settings in ([f'{k}={v}' for k, v in ALL_TRICKS_OFF.items()], ['whitening=learned']):
        path = tmp_path / f'{len(settings)}.json'
        argv = ['--tiny', '--epochs', '1', '--data-dir', str(dataset), '--json', str(path), '--set', *settings]
        assert T.main(argv) == 0
        out, job = capsys.readouterr().out, json.loads(path.read_text())
        row = job['runs'][0]['rows'][0]
        assert all(math.isfinite(row[k]) for k in ('train_loss', 'valid_loss', 'valid_acc', 'plain_acc'))
        if len(settings) > 1:
            assert {k: job['hyperparameters'][k] for k in ALL_TRICKS_OFF} == ALL_TRICKS_OFF
            assert 'label_smoothing=0, ' in out and 'valid = accuracy (no TTA, no EMA' in out
            assert row['valid_acc'] == row['plain_acc'] and 'without flip-TTA' not in out
        else:
            assert job['hyperparameters']['whitening'] == 'learned' and 'whitening=learned' in out
            assert 'without flip-TTA (each image alone): mean' in out


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------
def test_tiny_run_learns_prints_the_table_and_writes_its_files(dataset, tmp_path, monkeypatch, capsys):
    """--tiny, with CIFAR10_DIR set on that copy (where it must learn too). One epoch a run: it learns
    (the EMA that is evaluated, at 0.9 from its initial weights, needs more) and makes every line and
    file that four do; the job file holds the script that made it."""
    pytest.importorskip('matplotlib')                            # --plot's; CI installs it
    data_dir, out, epochs = Path(CIFAR10_DIR or dataset), tmp_path / 'out', 1
    out.mkdir()
    result = run_script('--tiny', '--epochs', str(epochs), '--device', 'cpu', '--data-dir', str(data_dir),
                        '--runs', '2', '--json', str(out / 'r.json'), '--plot', str(out / 'r.png'),
                        '--save', str(out / 'ema.pt'))
    assert result.returncode == 0, result.stderr
    assert 'Traceback' not in result.stderr
    lines = result.stdout.splitlines()
    header = T.table_line(T.COLUMNS)
    assert lines.count(header) == 2
    for column in T.COLUMNS:
        assert column in header
    rows = [line for line in lines if len(line) == len(header) and line.split()[0].isdigit()]
    assert len(rows) == 2 * epochs
    if data_dir == dataset:
        assert 'NOT the official CIFAR-10' in result.stdout                  # the generated copy's md5s
    for text in ('accuracy (flip-TTA, EMA): mean', '95% confidence interval', 'min / median / max',
                 'time per run: mean', 'without flip-TTA (each image alone): mean'):
        assert text in result.stdout
    assert 'warm-up: untimed runs of 2 steps' in result.stdout
    assert '\r' not in result.stderr                              # no progress line in a piped log

    report = json.loads((out / 'r.json').read_text())
    assert report['script'] == SCRIPT.read_text()
    assert report['script_sha256'] == hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:16]
    assert (report['runs_finished'], report['runs_requested']) == (2, 2)
    assert [len(r['rows']) for r in report['runs']] == [epochs] * 2
    # chance is 0.1, within 0.01 (a standard deviation over 1000 images, 0.005 over 3000): 0.15 is
    # 5 of them above it; a first epoch measured 0.23 to 0.30 (generated and CIFAR-10)
    assert min(r['rows'][-1]['train_acc'] for r in report['runs']) > 0.15
    accuracies = [r['rows'][-1]['valid_acc'] for r in report['runs']]
    assert report['summary']['acc_mean'] == pytest.approx(np.mean(accuracies))
    assert f"mean {100 * np.mean(accuracies):.2f}" in result.stdout
    by_epoch = [np.mean([r['rows'][e]['valid_acc'] for r in report['runs']]) for e in range(epochs)]
    assert by_epoch[-1] == pytest.approx(np.mean(accuracies))
    assert 'mean by epoch: ' + ' '.join(f'{100 * a:.2f}' for a in by_epoch) + ' %' in lines   # its course
    last = report['runs'][1]['rows'][-1]
    assert png_size(out / 'r.png') == ONE_JOB_PNG and 'plot' not in report['options']   # not for --resume
    assert sorted(p.name for p in out.iterdir()) == ['ema.pt', 'r.json', 'r.png']   # no part files
    checkpoint = torch.load(out / 'ema.pt')                       # its normalisation: Page's, what the run used
    assert (checkpoint['mean'], checkpoint['std']) == (PAGE_MEAN, PAGE_STD)

    # the saved model, loaded, classifies the run's test images as the run's own evaluation did
    model = T.load_model(out / 'ema.pt')
    test = T.load_cifar10(data_dir / T.BATCHES_DIR)
    logits = T.test_logits(model, test['test_images'][:T.TINY['test_images']])
    labels = test['test_labels'][:T.TINY['test_images']]
    assert checkpoint['classes'] == T.CLASSES and checkpoint['hyperparameters']['test_images'] == len(labels)
    assert np.mean(logits.argmax(1).numpy() == labels) == pytest.approx(last['valid_acc'])


# ---------------------------------------------------------------------------------------------
# From Python: train() and test_logits()
# ---------------------------------------------------------------------------------------------
def test_a_subset_trained_from_python_is_the_command_lines_run_row_for_row(dataset, tmp_path):
    """train() on the first 640 training images, tiny, equals --tiny --set train_images=640: the rows
    but for the clocks, and the EMA model (--save's) bit for bit; its test logits are the run's."""
    data = T.load_cifar10(dataset / T.BATCHES_DIR)
    subset = {**data, 'train_images': data['train_images'][:640], 'train_labels': data['train_labels'][:640]}
    model, rows = T.train(subset, tiny=True, hyp={'epochs': 2}, seed=3)
    path = tmp_path / 'r.json'
    argv = ['--tiny', '--epochs', '2', '--set', 'train_images=640', '--seed', '3', '--data-dir', str(dataset)]
    assert T.main([*argv, '--json', str(path), '--save', str(tmp_path / 'ema.pt')]) == 0
    run, = T.read_job(path, '--json')['runs']
    assert [without_times(row) for row in rows] == without_times(run)['rows']
    saved = torch.load(tmp_path / 'ema.pt')['state_dict']
    assert all(torch.equal(t, saved[k]) for k, t in model.state_dict().items())
    assert not model.training and all(t.dtype == torch.float32 for t in model.parameters())
    labels = data['test_labels'][:T.TINY['test_images']]
    logits = T.test_logits(model, data['test_images'][:T.TINY['test_images']], batch_size=T.TINY['eval_batch_size'])
    assert logits.dtype == torch.float32 and logits.shape == (len(labels), 10)
    assert np.mean(logits.argmax(1).numpy() == labels) == rows[-1]['valid_acc']   # fp32 evaluated as the run


def test_a_second_call_reuses_the_networks_and_returns_a_model_of_its_own(dataset, monkeypatch):
    """The same settings: no new networks, no warm-up (see the compiled worker for compiles); the model
    of the first call is not the second's; other hyperparameters build anew."""
    data = T.load_cifar10(dataset / T.BATCHES_DIR)
    built, warm_up = [], T.warmed_up_trainer
    monkeypatch.setattr(T, 'warmed_up_trainer', lambda *args: built.append(args[1]) or warm_up(*args))
    monkeypatch.setattr(T, 'TRAINERS', {})
    first, _ = T.train(data, tiny=True, hyp={'epochs': 1}, seed=0)
    kept = copy.deepcopy(first.state_dict())
    second, _ = T.train(data, tiny=True, hyp={'epochs': 1}, seed=1)
    assert len(built) == 1 and all(torch.equal(t, kept[k]) for k, t in first.state_dict().items())
    assert not torch.equal(first.head.weight, second.head.weight)
    T.train(data, tiny=True, hyp={'epochs': 1, 'label_smoothing': 0.1})
    assert len(built) == 2


@pytest.mark.parametrize('whitening', ['fixed', 'learned', 'none'])
def test_a_model_saves_and_loads_in_one_call_each_as_does_a_jobs_save(dataset, tmp_path, whitening):
    """For each whitening (a buffer, a weight, no such layer): the model train() returns and the one
    --save wrote for the same run load into models whose test logits are the returned model's, bit
    for bit. The loaded model says how many images trained and scored it."""
    data = T.load_cifar10(dataset / T.BATCHES_DIR)
    model, rows = T.train(data, tiny=True, hyp={'epochs': 1, 'whitening': whitening})
    T.save_model(model, tmp_path / 'model.pt')
    assert T.main(['--tiny', '--epochs', '1', '--set', f'whitening={whitening}', '--data-dir', str(dataset),
                   '--save', str(tmp_path / 'job.pt')]) == 0
    images = data['test_images'][:100]
    expected = T.test_logits(model, images)
    for path in ('model.pt', 'job.pt'):
        loaded = T.load_model(tmp_path / path)
        assert torch.equal(T.test_logits(loaded, images), expected), path
        assert (loaded.hyp['train_images'], loaded.hyp['test_images']) == (1000, 200)
        assert loaded.hyp['whitening'] == whitening and not loaded.training
    assert torch.load(tmp_path / 'job.pt')['accuracy'] == rows[-1]['valid_acc']


def test_train_learns_the_labels_it_is_given(dataset):
    """Every training label 3 (int32, not the loader's int64): after one epoch the model answers 3 for
    every test image, whatever the image's own class (the generated classes are all ten)."""
    data = T.load_cifar10(dataset / T.BATCHES_DIR)
    relabelled = dict(data, train_labels=np.full(len(data['train_labels']), 3, np.int32))
    model, rows = T.train(relabelled, tiny=True, hyp={'epochs': 1})
    assert set(data['test_labels']) == set(range(10))
    assert (T.test_logits(model, data['test_images']).argmax(1) == 3).all()


@pytest.mark.parametrize('change, message', [
    (dict(train_images=lambda x: x.astype(np.float32)),
     "data['train_images'], data['train_labels']: not uint8 N x 3 x 32 x 32 images but float32 (1000, 3, 32, 32)"),
    (dict(test_images=lambda x: x[:, :, :16]),
     "data['test_images'], data['test_labels']: not uint8 N x 3 x 32 x 32 images but uint8 (200, 3, 16, 32)"),
    (dict(test_images=None), "data has no 'test_images' or no 'test_labels'"),
    (dict(train_labels=lambda y: y[:10]), "data['train_images'], data['train_labels']: not 1000 integer labels"),
    (dict(test_labels=lambda y: y + 0.5), "data['test_images'], data['test_labels']: not 200 integer labels"),
    (dict(train_labels=lambda y: y + 1), "data['train_images'], data['train_labels']: labels from 1 to 10, not "
                                        'within 0-9'),
    (dict(train_images=lambda x: x[:40], train_labels=lambda y: y[:40]),
     'batch_size=64: more than the 40 training images'),
])
def test_bad_input_to_train_is_one_error_naming_it(dataset, monkeypatch, change, message):
    monkeypatch.setattr(T, 'warmed_up_trainer', lambda *args: pytest.fail('work started'))
    data = T.load_cifar10(dataset / T.BATCHES_DIR)
    data.update({key: f(data[key]) for key, f in change.items() if f})
    data = {key: value for key, value in data.items() if key not in change or change[key]}
    with pytest.raises(ValueError) as refusal:
        T.train(data, tiny=True)
    assert str(refusal.value).startswith(message) and '\n' not in str(refusal.value)


@pytest.mark.parametrize('hyp, why', [
    ({'lr': 0.1}, 'hyp: lr: no such hyperparameter (HYP lists them)'),
    ({'label_smothing': 0.1}, 'hyp: label_smothing: no such hyperparameter, did you mean label_smoothing? (HYP lists'),
    ({'epochs': 0}, 'hyp: epochs=0: must be a finite number of at least 1'),
    ({'epochs': 2.5}, 'hyp: epochs=2.5: must be an integer, as epochs=10'),
    ({'epochs': True}, 'hyp: epochs=True: must be an integer'),
    ({'lr_peak': '0.5'}, "hyp: lr_peak='0.5': must be a number"),
    ({'flip_tta': 1}, 'hyp: flip_tta=1: must be True or False, as flip_tta=True'),
    ({'channels': (8, 16)}, 'hyp: channels=(8, 16): must be 4 integers, as channels=64,128,256,512'),
    ({'channels': (8, 16, 32, 64.0)}, 'hyp: channels=(8, 16, 32, 64.0): must be 4 integers'),
])
def test_a_hyperparameter_of_the_wrong_name_or_type_is_one_error_naming_it(dataset, monkeypatch, hyp, why):
    """Refused before any work, in one line naming the setting: numpy's integers and floats are numbers."""
    monkeypatch.setattr(T, 'warmed_up_trainer', lambda *args: pytest.fail('work started'))
    data = T.load_cifar10(dataset / T.BATCHES_DIR)
    with pytest.raises(T.UserError) as refusal:
        T.train(data, tiny=True, hyp=hyp)
    assert str(refusal.value).startswith(why) and '\n' not in str(refusal.value)
    for fine in ({'epochs': np.int64(2)}, {'lr_peak': np.float32(0.5)}, {'lr_peak': 1}, {'channels': [8, 8, 16, 16]}):
        assert T.hyp_problem({**T.HYP, **fine}) is None


@pytest.mark.parametrize('images, why', [
    (lambda x: x.astype(np.float32) / 255, 'images: not uint8 N x 3 x 32 x 32 images but float32 (5, 3, 32, 32)'),
    (lambda x: x.transpose(0, 2, 3, 1), 'images: not uint8 N x 3 x 32 x 32 images but uint8 (5, 32, 32, 3)'),
])
def test_test_logits_refuses_what_is_not_uint8_images_in_one_line_and_leaves_the_models_mode(images, why):
    model, _ = small_model()
    data = constant_data(n_test=5)
    with pytest.raises(T.UserError) as refusal:
        T.test_logits(model, images(data['test_images']))
    assert str(refusal.value) == why
    model.train()
    assert T.test_logits(model, data['test_images']).shape == (5, 10) and model.training


def test_training_leaves_the_callers_random_state_as_it_was(dataset, tmp_path, capsys):
    """A notebook's own draws go on as if no run had drawn, from Python and through main, and torch's
    settings (cuDNN's benchmark, TF32) are as they were, whatever they were."""
    data = T.load_cifar10(dataset / T.BATCHES_DIR)
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32
    try:
        for flags in [(True, True, True), (False, False, True)]:
            cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = flags
            torch.manual_seed(123)
            expected = torch.rand(3)
            torch.manual_seed(123)
            T.train(data, tiny=True, hyp={'epochs': 1}, progress=True)
            assert T.main([*SMALL_RUN, '--data-dir', str(dataset)]) == 0
            assert torch.equal(torch.rand(3), expected)
            assert (cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32) == flags
    finally:
        cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = saved
    assert re.match(r'seed 0: valid accuracy \d+\.\d\d % after 1 epochs, [\d.]+ s$', capsys.readouterr().out.split('\n')[0])


def test_the_readmes_python_blocks_run_as_written(dataset, tmp_path, monkeypatch, capsys):
    """The From Python section's blocks, in one namespace as a notebook runs them: on the stand-in
    in CI (CIFAR10_DIR), else on a generated copy of 1,500 training images."""
    readme = (SCRIPT.parent / 'README.md').read_text()
    blocks = [block.split('```')[0] for block in readme.split('## From Python')[1].split('## ')[0]
              .split('```python\n')[1:]]
    assert len(blocks) == 2
    data_dir = Path(CIFAR10_DIR or write_dataset(tmp_path / 'data', per_batch=300).parent)
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'data').symlink_to(data_dir)
    monkeypatch.chdir(tmp_path / 'run')
    monkeypatch.setitem(sys.modules, 'train_cifar10', T)
    namespace = {}
    for block in blocks:
        exec(block, namespace)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(':')[0] for line in out[:3]] == ['least sure', 'random', 'least sure - random']
    assert all(re.search(r'\d+\.\d\d %$', line) for line in out[:2])
    assert re.fullmatch(r'\d+\.\d% of 500 test images', out[3]) and (tmp_path / 'run' / 'model.pt').exists()


def test_seeds_make_runs_repeatable_and_different(dataset, tmp_path):
    """--seed 5 --runs 2 trains seeds 5 and 6, which differ; --seed 6 alone repeats the second."""
    def valid_losses(*args):
        path = tmp_path / f'{len(list(tmp_path.iterdir()))}.json'  # a new job, a new file
        assert T.main(['--tiny', '--data-dir', str(dataset), '--epochs', '1', *args, '--json', str(path)]) == 0
        return [[row['valid_loss'] for row in run['rows']] for run in json.loads(path.read_text())['runs']]
    five, six = valid_losses('--seed', '5', '--runs', '2')
    assert five != six and valid_losses('--seed', '6') == [six]


def test_a_diverged_run_is_reported_as_failed(dataset, tmp_path, capsys):
    """A strange value given by --set is the researcher's experiment: it trains, and says what it did."""
    status = T.main(['--tiny', '--data-dir', str(dataset), '--epochs', '3', '--set', 'lr_peak=1e12',
                     '--json', str(tmp_path / 'r.json')])
    out = capsys.readouterr().out
    assert status == 1 and 'run 1 FAILED' in out and 'runs: 0 finished, 1 failed' in out
    assert 'no run finished' in out and 'accuracy (flip-TTA, EMA): mean' not in out
    report = json.loads((tmp_path / 'r.json').read_text())
    assert report['runs'][0]['failed'] and 'acc_mean' not in report['summary']


def test_a_run_whose_training_loss_is_not_finite_is_failed(dataset, tmp_path, monkeypatch, capsys):
    """A NaN training loss fails the run even where its evaluation still gave a finite loss."""
    real = T.train_epoch

    def nan_in_training(*args, **kwargs):
        loss, correct = real(*args, **kwargs)
        return loss * math.nan, correct
    monkeypatch.setattr(T, 'train_epoch', nan_in_training)
    status = T.main(['--tiny', '--data-dir', str(dataset), '--epochs', '1', '--json', str(tmp_path / 'r.json')])
    out = capsys.readouterr().out
    assert status == 1 and 'run 1 FAILED' in out and 'runs: 0 finished, 1 failed' in out
    run = T.read_job(tmp_path / 'r.json', '--json')['runs'][0]
    assert run['failed'] and math.isfinite(run['rows'][-1]['valid_loss'])


@pytest.mark.parametrize('stage', ['pick_dtype', 'ensure_cifar10', 'load_cifar10', 'warmed_up_trainer', 'train_run'])
def test_ctrl_c_at_any_stage_ends_cleanly(dataset, tmp_path, monkeypatch, capsys, stage):
    """Ctrl-C while the device is probed, the data found or loaded, during the warm-up or in run 2:
    status 130, no traceback, the summary of the finished runs if any, no half-written file."""
    real = getattr(T, stage)

    def interrupt(*args, **kwargs):
        seed = kwargs.get('seed', args[4] if len(args) > 4 else None)
        if stage != 'train_run' or seed == 11:                    # train_run: in run 2 of seeds 10, 11, 12
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(T, stage, interrupt)
    status = T.main(['--tiny', '--data-dir', str(dataset), '--epochs', '1', '--runs', '3', '--seed', '10',
                     '--json', str(tmp_path / 'r.json')])
    out = capsys.readouterr().out
    assert status == 130 and 'interrupted' in out
    if stage == 'train_run':
        assert (f"interrupted after 1 finished run(s); --resume {tmp_path / 'r.json'} goes on\n"
                in out and 'runs: 1 finished\n' in out)
        assert json.loads((tmp_path / 'r.json').read_text())['runs_finished'] == 1
        monkeypatch.undo()                                        # the line's command, as it says
        assert T.main(['--resume', str(tmp_path / 'r.json')]) == 0
        runs = json.loads((tmp_path / 'r.json').read_text())['runs']
        assert [(run['run'], run['seed'], len(run['rows'])) for run in runs] == [(1, 10, 1), (2, 11, 1), (3, 12, 1)]
    else:
        assert 'runs:' not in out and leftovers(tmp_path) == []
        assert out.endswith('interrupted after 0 finished run(s)\n')   # nothing to --resume yet


def test_ctrl_c_as_a_finished_job_ends_changes_nothing(finished_job, tmp_path, monkeypatch, capsys):
    """Ctrl-C after the last run, while the summary is made: the summary and status 0, no
    traceback, the file as it was."""
    (source, text), options = copy_of(finished_job[0], tmp_path), finished_job[1]
    no_training(monkeypatch)
    real = T.summary_lines

    def interrupted_summary(summary):                             # where the job ends
        signal.raise_signal(signal.SIGINT)                        # returns once its handler has run
        return real(summary)
    monkeypatch.setattr(T, 'summary_lines', interrupted_summary)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)   # ignored in a shell's `&` job
    try:
        assert T.main([*options, '--runs', '2', '--resume', str(source)]) == 0
    finally:
        signal.signal(signal.SIGINT, before)
    assert 'runs: 2 finished' in capsys.readouterr().out and source.read_bytes() == text


def test_ctrl_c_while_a_run_is_kept_reports_the_runs_its_file_holds(dataset, tmp_path, monkeypatch, capsys):
    """Ctrl-C after run 2 has finished but before its file is rewritten: the summary is of the runs on
    disk, which --resume reads back, not of a run the file lacks."""
    write, calls = T.write_atomically, []

    def interrupted_write(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt                               # as a Ctrl-C there would
        write(path, data)
    monkeypatch.setattr(T, 'write_atomically', interrupted_write)
    path = tmp_path / 'r.json'
    assert T.main([*SMALL_RUN, '--runs', '3', '--data-dir', str(dataset), '--json', str(path)]) == 130
    out = capsys.readouterr().out
    assert 'interrupted after 1 finished run(s)' in out and 'runs: 1 finished' in out
    assert T.read_job(path, '--json')['runs_finished'] == 1


def test_ctrl_c_during_a_download_leaves_no_part(tmp_path, monkeypatch, capsys):
    class Response:                                               # 1 kB arrives, then Ctrl-C
        headers = {'Content-Length': '2000000'}
        chunks = [b'x' * 1000]

        def read(self, n):
            if self.chunks:
                return self.chunks.pop()
            raise KeyboardInterrupt

        def __enter__(self):
            return self

        def __exit__(self, *args):
            pass
    monkeypatch.setattr(T.urllib.request, 'urlopen', lambda *args, **kwargs: Response())
    assert T.main(['--tiny', '--data-dir', str(tmp_path / 'data')]) == 130
    assert 'interrupted' in capsys.readouterr().out
    assert leftovers(tmp_path / 'data') == []                      # no part file


def without_times(run):
    """A run's record less what the clock measured: what a deterministic CPU repeats exactly."""
    times = ('time_s', 'train_time', 'valid_time', 'total_time')
    return {k: [without_times(row) for row in v] if k == 'rows' else v for k, v in run.items() if k not in times}


def test_a_job_killed_mid_way_keeps_its_results_and_resumes_where_it_stopped(dataset, tmp_path, one_process_job):
    """SIGKILL once run 1 has finished: its record and model are whole on disk, and --resume
    trains runs 2-3 into the runs of an uninterrupted job (one_process_job's, one thread as here)."""
    paths = {name: tmp_path / name for name in ('r.json', 'ema.pt')}
    job = ['--tiny', '--epochs', '1', '--runs', '3', '--data-dir', str(dataset), '--save', str(paths['ema.pt'])]
    one_thread = {**os.environ, 'OMP_NUM_THREADS': '1'}
    killed = subprocess.Popen([sys.executable, '-u', str(SCRIPT), *job, '--json', str(paths['r.json'])],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=one_thread)
    try:
        for line in killed.stdout:
            if line.startswith('run 2/3'):                        # run 1 has finished
                killed.kill()                                     # no chance to clean up: SIGKILL
                break
    finally:
        killed.kill()
        killed.wait(timeout=60)
        killed.stdout.close()
    report = json.loads(paths['r.json'].read_text())
    assert (report['runs_finished'], report['runs_requested']) == (1, 3) and len(report['runs']) == 1
    assert torch.load(paths['ema.pt'])['run'] == 1

    resumed = subprocess.run([sys.executable, str(SCRIPT), *job, '--resume', str(paths['r.json'])],
                             capture_output=True, text=True, timeout=300, env=one_thread)
    assert resumed.returncode == 0, resumed.stderr
    assert f"1 run(s) read back from {paths['r.json']}" in resumed.stdout and 'run 1/3' not in resumed.stdout
    assert 'runs: 3 finished' in resumed.stdout and 'job: 2 runs in' in resumed.stdout
    final = json.loads(paths['r.json'].read_text())
    assert (final['runs_finished'], final['runs_requested']) == (3, 3)
    assert final['runs'][0] == report['runs'][0]                  # the record written before the kill
    assert torch.load(paths['ema.pt'])['run'] == 3
    uninterrupted = one_process_job['runs'][:3]                # seeds 0-2 of the same options
    assert [without_times(r) for r in final['runs']] == [without_times(r) for r in uninterrupted]


@pytest.mark.parametrize('flag', ['--json', '--save'])
def test_a_full_disk_stops_the_job_in_one_line_and_resume_finishes_it(dataset, tmp_path, monkeypatch, capsys, flag):
    """The second run's file meets a full disk halfway: one line saying what failed and what to do,
    a non-zero status, no temporary file, and the job file at its last good version."""
    job, model = tmp_path / 'job.json', tmp_path / 'model.pt'
    options = ['--tiny', '--epochs', '1', '--data-dir', str(dataset), '--runs', '3', '--save', str(model)]
    failing = {'--json': job, '--save': model}[flag]
    write_bytes, writes = Path.write_bytes, []

    def full_disk(self, data):
        if self.name.startswith(f'.{failing.name}.'):
            writes.append(self)
            if len(writes) == 2:
                write_bytes(self, data[:len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_bytes(self, data)
    monkeypatch.setattr(Path, 'write_bytes', full_disk)
    assert T.main([*options, '--json', str(job)]) == 1
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == f'error: cannot write {failing} (No space left on device)'
    kept = 1 if flag == '--json' else 2                           # the summary is of the file's runs
    assert 'Traceback' not in err and f'runs: {kept} finished' in out
    assert [run['run'] for run in json.loads(job.read_text())['runs']] == ([1] if flag == '--json' else [1, 2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['job.json', 'model.pt']
    monkeypatch.undo()
    assert T.main([*options, '--resume', str(job)]) == 0
    assert [run['run'] for run in json.loads(job.read_text())['runs']] == [1, 2, 3]


def test_a_job_whose_runs_take_minutes_says_when_it_should_end(dataset, monkeypatch, capsys):
    """On a clock the test moves, each run of a 3-run job takes 90 s: after run 1, 2 runs are left
    and the job should end 180 s later; after run 2, 90 s later; after run 3 nothing is said. A job
    whose runs take less than a minute says nothing."""
    clock, train_run = [0.0], T.train_run

    def ninety_seconds(*args, **kwargs):
        clock[0] += 90.0
        return train_run(*args, **kwargs)
    monkeypatch.setattr(T.time, 'perf_counter', lambda: clock[0])
    monkeypatch.setattr(T, 'train_run', ninety_seconds)

    class Now(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 12, 2, 13, 59, 0)
    monkeypatch.setattr(T.datetime, 'datetime', Now)
    assert T.main(['--tiny', '--epochs', '1', '--runs', '3', '--data-dir', str(dataset)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if 'should end' in line]
    assert said == ['2 run(s) left, 1.5 min each: the job should end at about 14:02 on Wed 02 Dec',
                    '1 run(s) left, 1.5 min each: the job should end at about 14:00 on Wed 02 Dec']
    monkeypatch.undo()                                            # the real clock: runs of seconds
    assert T.main(['--tiny', '--epochs', '1', '--runs', '2', '--data-dir', str(dataset)]) == 0
    assert 'should end' not in capsys.readouterr().out


def test_a_closed_output_stops_the_job_quietly_and_keeps_its_finished_runs(dataset, tmp_path):
    """`train_cifar10.py ... | head`: the job stops at its next line as Unix tools do (by SIGPIPE,
    which a shell reports as 141), with no traceback and the runs it finished in its file; --compare too."""
    job = tmp_path / 'job.json'
    child = subprocess.Popen([sys.executable, str(SCRIPT), '--tiny', '--epochs', '1', '--data-dir', str(dataset),
                              '--runs', '3', '--json', str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in child.stdout:
        if line.startswith('run 2/3'):
            break
    child.stdout.close()
    assert child.wait(timeout=300) == -signal.SIGPIPE and child.stderr.read() == ''
    assert [run['run'] for run in json.loads(job.read_text())['runs']] in ([1], [1, 2])
    a, b = tmp_path / 'a.json', tmp_path / 'b.json'
    write_job(a, job_with(job, [0.3, 0.4]))
    write_job(b, job_with(job, [0.5, 0.7]))
    read_end, write_end = os.pipe()
    os.close(read_end)                                            # closed before anything is written
    result = subprocess.run([sys.executable, str(SCRIPT), '--compare', str(a), str(b)], stdout=write_end,
                            stderr=subprocess.PIPE, text=True, timeout=300)
    os.close(write_end)
    assert result.returncode == -signal.SIGPIPE and result.stderr == ''


@pytest.fixture(scope='module')
def finished_job(dataset, tmp_path_factory):
    """The --json file of a finished 2-run --tiny job of one epoch, and the options that made it."""
    path = tmp_path_factory.mktemp('job') / 'job.json'
    options = ['--tiny', '--epochs', '1', '--data-dir', str(dataset)]
    assert T.main([*options, '--runs', '2', '--json', str(path)]) == 0
    return path, options


def write_job(path, job):
    """A job's file as the script writes one (with the sha256 of its content), holding what a test
    changed in it."""
    job = {k: v for k, v in job.items() if k != 'sha256'}
    path.write_text(json.dumps({**job, 'sha256': T.job_sha256(job)}))


def no_training(monkeypatch):
    """Every run's networks come from warmed_up_trainer."""
    monkeypatch.setattr(T, 'warmed_up_trainer', lambda *args, **kwargs: pytest.fail('it trained'))


@pytest.mark.parametrize('key, value, message', [
    ('script_sha256', '0123456789abcdef', None),                 # an edited script, alone
    ('hyperparameters', {'cutout': 8}, 'cutout (8 -> 0)'),
    ('dtype', 'torch.float16', 'dtype (torch.float16 -> torch.float32)'),
    ('device', 'NVIDIA H100 80GB HBM3, CUDA 12.8', 'device (NVIDIA H100 80GB HBM3, CUDA 12.8 -> CPU'),
    ('data', 'official CIFAR-10', 'data (official CIFAR-10 -> NOT the official'),
    ('data_digest', '0000000000000000', 'data_digest (0000000000000000 -> '),
    ('seed', 7, 'seed (7 -> 0)'),
])
def test_resume_refuses_a_different_job_and_leaves_its_file(finished_job, tmp_path, monkeypatch, capsys,
                                                            key, value, message):
    source, options = finished_job
    job = json.loads(source.read_text())
    job[key] = {**job[key], **value} if isinstance(value, dict) else value
    for run in job['runs']:                                       # a job from another first seed
        run['seed'] = job['seed'] + run['run'] - 1                # has its runs' seeds too
    path = tmp_path / 'other.json'
    write_job(path, job)
    text = path.read_bytes()
    no_training(monkeypatch)
    assert T.main([*options, '--runs', '3', '--resume', str(path)]) == 1
    err = capsys.readouterr().err.strip()
    if message is None:
        message = ('script_sha256 (0123456789abcdef -> '
                   f'{hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:16]}), that job')
    message = f'that job differs from this one in {message}'
    assert err.startswith(f'error: --resume {path}: {message}') and '\n' not in err
    assert path.read_bytes() == text


@pytest.mark.parametrize('content, runs, message', [
    (None, 3, r'no such file \(a new job starts with --json\)$'),
])
def test_resume_refuses_a_file_that_is_not_a_job_of_its_own_in_one_line(finished_job, tmp_path, monkeypatch,
                                                                        capsys, content, runs, message):
    source, options = finished_job
    path = tmp_path / 'job.json'
    if content:
        path.write_text(content(source.read_text()))
    text = path.read_bytes() if content else None
    no_training(monkeypatch)
    assert T.main([*options, '--runs', str(runs), '--resume', str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith('error: --resume ') and str(path) in err and re.search(message, err) and '\n' not in err
    assert (path.read_bytes() if content else path.exists()) == (text if content else False)
    assert sorted(p.name for p in tmp_path.iterdir()) == (['job.json'] if content else [])


def test_resume_of_a_finished_job_prints_its_tables_and_summary_and_trains_nothing(finished_job, monkeypatch,
                                                                                  capsys, tmp_path):
    """It says how many runs it read back, and its file stays as it is, its summary too; --plot draws
    its runs."""
    pytest.importorskip('matplotlib')                            # --plot's; CI installs it
    source, text = copy_of(finished_job[0], tmp_path)
    options, runs = finished_job[1], T.read_job(source, '--resume')['runs']
    no_training(monkeypatch)                                      # no warm-up, no run
    drawn = []
    monkeypatch.setattr(T, 'plot_jobs', lambda path, jobs, *names: drawn.append((path, jobs[0]['runs'])))
    assert T.main([*options, '--runs', '2', '--resume', str(source), '--plot', str(tmp_path / 'a.png')]) == 0
    out = capsys.readouterr().out
    assert f'\n2 run(s) read back from {source}\n' in out and 'untimed run' not in out
    assert T.table_line(T.COLUMNS) not in out and 'runs: 2 finished\n' in out
    assert f"mean {100 * np.mean([r['accuracy'] for r in runs]):.2f} %" in out
    assert source.read_bytes() == text
    assert drawn == [(str(tmp_path / 'a.png'), runs)]


def test_resume_rewrites_its_own_files_and_no_other(finished_job, tmp_path, monkeypatch, capsys):
    """A resumed job rewrites the --save its file names; any other file that exists is refused, as
    for a new job."""
    source, options = finished_job
    path, _ = copy_of(source, tmp_path)
    notes = tmp_path / 'notes.pt'
    notes.write_text('my notes')
    no_training(monkeypatch)
    assert T.main([*options, '--runs', '2', '--resume', str(path), '--save', str(notes)]) == 1
    assert capsys.readouterr().err == (f"error: --save '{notes}': exists, and a new job overwrites no "
                                       'file: give another path, or --resume its job\n')
    assert notes.read_text() == 'my notes'


def test_resume_reads_back_a_failed_run_as_failed(finished_job, tmp_path, monkeypatch, capsys):
    """A run whose loss became NaN is written with nulls (JSON has no NaN); read back, it stays
    failed, and the job's status is 1."""
    source, options = finished_job
    job = json.loads(source.read_text())
    job['runs'][1].update(failed=True, accuracy=None)
    job['runs'][1]['rows'][-1].update(train_loss=None, valid_loss=None)
    path = tmp_path / 'job.json'
    write_job(path, job)
    no_training(monkeypatch)
    assert T.main([*options, '--runs', '2', '--resume', str(path)]) == 1
    out = capsys.readouterr().out
    assert 'runs: 1 finished, 1 failed (the loss not finite)' in out


def test_set_changes_any_hyperparameter_and_resume_and_compare_carry_it(finished_job, tmp_path, capsys):
    """--set label_smoothing=0.1 channels=8,16,32,32, no edit: the header and the job file record
    them, the saved model has those widths, the losses differ from the default job's (the same
    options and seeds); --resume keeps the setting (and refuses another), --compare names it."""
    source, options = finished_job
    path, model = tmp_path / 'set.json', tmp_path / 'ema.pt'
    assert T.main([*options, '--set', 'label_smoothing=0.1', 'channels=8,16,32,32', '--json', str(path),
                   '--save', str(model)]) == 0
    out = capsys.readouterr().out
    assert 'label_smoothing=0.1,' in out and 'channels=(8, 16, 32, 32),' in out
    job = T.read_job(path, '--json')
    assert job['hyperparameters']['label_smoothing'] == 0.1 and job['hyperparameters']['channels'] == [8, 16, 32, 32]
    assert job['options']['set'] == ['epochs=1', 'label_smoothing=0.1', 'channels=8,16,32,32']  # as typed
    state = torch.load(model)['state_dict']
    assert state['layer3.0.0.weight'].shape == (32, 32, 3, 3) and state['head.weight'].shape == (10, 32)
    default = T.read_job(source, '--json')['runs'][0]['rows'][0]
    assert job['runs'][0]['rows'][0]['train_loss'] != pytest.approx(default['train_loss'], rel=1e-3)
    assert T.main(['--resume', str(path), '--set', 'label_smoothing=0.2']) == 1     # by name: channels kept
    assert "differs from this one in label_smoothing (0.1 -> 0.2), that job's" in capsys.readouterr().err
    # the file's options, its --set too; a value given here again (--epochs 1 is --set epochs=1) is the same job
    assert T.main(['--resume', str(path), '--runs', '2', '--set', 'epochs=1', '--set', 'channels=8,16,32,32']) == 0
    job = T.read_job(path, '--json')
    assert [run['run'] for run in job['runs']] == [1, 2] and 'epochs' not in job['options']
    assert job['options']['set'] == ['epochs=1', 'label_smoothing=0.1', 'channels=8,16,32,32', 'epochs=1',
                                     'channels=8,16,32,32']       # in order: the last value of each wins
    assert T.main(['--resume', str(path), '--epochs', '1']) == 0
    assert T.main(['--compare', str(source), str(path)]) == 0
    assert ('B differs from A in: label_smoothing (0.2 -> 0.1), channels ([8, 16, 32, 64] -> [8, 16, 32, 32])'
            in capsys.readouterr().out)


@pytest.mark.parametrize('setting, status, message', [
    ('lr_peek=2', 1, "error: --set 'lr_peek=2': no such hyperparameter, did you mean lr_peak? (HYP lists them)\n"),
    ('label_smothing=0.1', 1, "error: --set 'label_smothing=0.1': no such hyperparameter, did you mean "
                              'label_smoothing? (HYP lists them)\n'),
    ('=3', 1, "error: --set '=3': no such hyperparameter (HYP lists them)\n"),
    ('ema_every=2.5', 1, 'error: --set ema_every=2.5: must be an integer, as ema_every=5\n'),
    ('channels=8,x,32,64', 1, "error: --set channels='8,x,32,64': must be 4 integers, as channels=64,128,256,512\n"),
    ('channels=8,16', 1, "error: --set channels=(8, 16): must be 4 integers, as channels=64,128,256,512\n"),
    ('label_smoothing', 1, "error: --set 'label_smoothing': not NAME=VALUE as label_smoothing=0.2\n"),  # a space for =
    ('flip_tta=false', 1, "error: --set flip_tta='false': must be True or False, as flip_tta=True\n"),
    ('bn_scale_frozen=1', 1, 'error: --set bn_scale_frozen=1: must be True or False, as bn_scale_frozen=True\n'),
    ('channels=(8, 0, 32, 64)', 1, 'error: --set channels=8,0,32,64: must be a finite number of at least 1\n'),   # would crash a run
    ('bn_split_size=-1', 1, 'error: --set bn_split_size=-1: must be a finite number of at least 0\n'),
    ('celu_alpha=-0.1', 1, 'error: --set celu_alpha=-0.1: must be a finite number of at least 0\n'),
    ('whitening=learnt', 1, 'error: --set whitening=learnt: must be fixed, learned or none\n'),
    ('bn_split_size=24', 1, "error: --set batch_size=64: must be a multiple of ghost batch norm's split, 24\n"),
    ('lr_peak=nan', 1, "error: --set lr_peak='nan': must be a number, as lr_peak=1.0\n"),     # no literal: a string
    ('lr_peak=1e999', 1, 'error: --set lr_peak=inf: must be a finite number of at least 0\n'),
    ('weight_decay=-5e-4', 1, 'error: --set weight_decay=-0.0005: must be a finite number of at least 0\n'),
    ('train_images=0', 1, 'error: --set train_images=0: must be a finite number of at least 1\n'),
    ('label_smoothing=1.5', 1, 'error: --set label_smoothing=1.5: must be a finite number of at least 0 and at most 1\n'),
    ('pad=32', 1, 'error: --set pad=32: must be a finite number of at least 0 and at most 31\n'),  # reflect-pad
    ('cutout=33', 1, 'error: --set cutout=33: must be a finite number of at least 0 and at most 32\n'),
])
def test_a_set_that_names_nothing_does_not_parse_or_cannot_make_the_run_is_refused_in_one_line(
        dataset, monkeypatch, capsys, setting, status, message):
    """A name that is no setting (with the closest one), a value that does not parse, or one that makes
    no run: one line, status 1, before any work. A strange value is the researcher's to try
    (test_a_diverged_run_is_reported_as_failed)."""
    monkeypatch.setattr(T, 'pick_dtype', lambda *args: pytest.fail('work started'))
    assert T.main(['--tiny', '--data-dir', str(dataset), '--set', 'epochs=1', setting]) == status
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count('\n') == 1


def test_set_reads_a_value_as_a_python_literal_else_a_string():
    assert T.hyp_setting('bias_lr_scale=0.5') == ('bias_lr_scale', 0.5)        # a rate, though Page's is 64
    assert T.hyp_setting('epochs=3') == ('epochs', 3) and isinstance(T.hyp_setting('epochs=3')[1], int)
    assert T.hyp_setting('channels=(8, 16, 32, 64)') == T.hyp_setting('channels=8,16,32,64') == ('channels', (8, 16, 32, 64))
    assert T.hyp_setting('flip_tta=False') == ('flip_tta', False) and T.hyp_setting('weight_decay=-5e-4')[1] == -0.0005
    assert T.hyp_setting('whitening=learned') == ('whitening', 'learned')
    assert T.hyp_setting('lr_peak=__import__("os").remove("x")') == ('lr_peak', '__import__("os").remove("x")')  # runs nothing
    with pytest.raises(Exception, match="'LR_PEAK=2': no such hyperparameter"):
        T.hyp_setting('LR_PEAK=2')


def test_the_defaults_make_a_run_and_what_makes_none_is_refused():
    """HYP's and --tiny's values make a run; a negative number, a count of 0, NaN and infinity do not,
    in each of a tuple's values too; a name HYP lacks (from Python) neither."""
    for hyp in (T.HYP, {**T.HYP, **T.TINY}):
        assert T.hyp_problem(hyp) is None
    for name, value, refused in [('momentum', 0.0, False), ('momentum', 1.5, False), ('lr_peak', 1e300, False),
                                 ('lr_peak', -1.0, True), ('lr_peak', math.inf, True), ('lr_floor', math.nan, True),
                                 ('channels', (8, 16, 32, 64), False), ('channels', (8, 0, 32, 64), True),
                                 ('epochs', 1, False), ('epochs', 0, True), ('whitening', 'none', False),
                                 ('label_smoothing', 1.0, False), ('pad', 31, False), ('cutout', 32, False),
                                 ('dropout', 0.1, True)]:
        assert (T.hyp_problem({**T.HYP, name: value}) is not None) == refused, (name, value)


def test_a_setting_given_twice_takes_its_last_value(dataset, monkeypatch, capsys):
    """--epochs is --set epochs=...: one spelling, the last value given wins, as argparse's options do;
    --tiny's presets are values before them all."""
    monkeypatch.setattr(T, 'warmed_up_trainer', lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    assert T.main(['--tiny', '--data-dir', str(dataset), '--epochs', '3', '--set', 'epochs=2', 'cutout=8',
                   '--set', 'cutout=4', '--batch-size', '32']) == 130
    out = capsys.readouterr().out
    assert 'epochs=2, batch_size=32, ' in out and 'cutout=4, ' in out


def test_train_and_test_images_set_a_size_between_tiny_and_the_whole_job(dataset, monkeypatch, capsys):
    """The first N images of each set, a full-width network; without them set, all the folder holds (its
    1,000 training images, fewer than HYP's 50,000)."""
    monkeypatch.setattr(T, 'warmed_up_trainer', lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    for setting, images in [('train_images=640 --set test_images=50', '640 train / 50 test images'),
                            ('cutout=0', '1000 train / 200 test images')]:
        assert T.main(['--data-dir', str(dataset), '--no-compile', '--set', *setting.split()]) == 130
        out = capsys.readouterr().out
        assert images in out and 'channels=(64, 128, 256, 512)' in out


def test_plot_on_a_full_disk_says_so_in_one_line_and_leaves_an_old_picture_whole(dataset, tmp_path, monkeypatch,
                                                                                capsys):
    """--plot writes through a temporary file, as --json does: a full disk at the end of a job is one
    line and status 1, the runs in their file, and the picture there before is left as it was."""
    pytest.importorskip('matplotlib')                            # --plot's; CI installs it
    picture, job = tmp_path / 'r.png', tmp_path / 'r.json'
    picture.write_bytes(b'an old picture')
    write_bytes = Path.write_bytes

    def full_disk(self, data):
        if self.name.startswith('.r.png.'):
            write_bytes(self, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_bytes(self, data)
    monkeypatch.setattr(Path, 'write_bytes', full_disk)
    assert T.main([*SMALL_RUN, '--data-dir', str(dataset), '--json', str(job), '--plot', str(picture)]) == 1
    out, err = capsys.readouterr()
    assert err == (f'error: --plot {picture} not drawn: cannot write {picture} (No space left on '
                   'device)\n') and 'runs: 1 finished' in out
    assert picture.read_bytes() == b'an old picture' and T.read_job(job, '--json')['runs_finished'] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ['r.json', 'r.png']     # no part file


def test_the_pictures_epoch_axis_shows_whole_epochs(tmp_path):
    pytest.importorskip('matplotlib')                            # --plot's; CI installs it
    for epochs in (1, 2, 3, 10):
        curves = T.plot_jobs(tmp_path / f'{epochs}.png', [drawn_job([0.9, 0.92], epochs=epochs)]).axes[0]
        low, high = curves.get_xlim()
        ticks = [tick for tick in curves.get_xticks() if low <= tick <= high]
        assert ticks and all(float(tick).is_integer() for tick in ticks), (epochs, ticks)


def job_with(path, accuracies, **changes):
    """A copy of a real one-epoch job's file with these final accuracies (None: a failed run, whose
    losses became NaN) and settings."""
    job = json.loads(path.read_text())
    runs = []
    for i, accuracy in enumerate(accuracies):
        row = {**job['runs'][0]['rows'][0], 'valid_acc': 0.1 if accuracy is None else accuracy}
        if accuracy is None:
            row.update(train_loss=None, valid_loss=None)
        runs.append(dict(run=i + 1, seed=job['seed'] + i, failed=accuracy is None,
                         rows=[row], accuracy=row['valid_acc'], time_s=row['total_time']))
    job.update(runs=runs, runs_finished=len(runs), runs_requested=len(runs))
    job.update(changes)
    return job


ONE_JOB_PNG = (1200, 637)  # --plot's picture of one job: 8 x (4 + 1 / 4) inches at 150 dpi, rounded down


def png_size_of(data):
    """A PNG's width and height, read from its header (the IHDR chunk)."""
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and data[12:16] == b'IHDR'
    return int.from_bytes(data[16:20], 'big'), int.from_bytes(data[20:24], 'big')


def png_size(path):
    """A PNG file's width and height."""
    return png_size_of(Path(path).read_bytes())


def drawn_job(finals, epochs=3, **options):
    """A job's file as --plot reads it, by hand: run r's valid accuracy at epoch e is finals[r] - (epochs - e) /
    100; None: a failed run."""
    runs = [dict(run=r + 1, failed=final is None, rows=[dict(valid_acc=(final or 0) - (epochs - e) / 100)
                                                        for e in range(1, epochs + 1)], accuracy=final, time_s=5.0)
            for r, final in enumerate(finals)]
    return dict(device='CPU (x86_64, AVX512 kernels, 2 threads)', dtype='torch.float32', runs=runs,
                options={'tiny': False, 'set': [], **options})


def test_a_jobs_picture_holds_its_values(tmp_path):
    """Read from the figure's artists: each epoch's mean and extremes of valid accuracy over the finished
    runs, the settings in the legend, the device in the title; the file a PNG of 8 x 4.25 inches."""
    pytest.importorskip('matplotlib')                            # --plot's; CI installs it
    figure = T.plot_jobs(tmp_path / 'a.png', [drawn_job([0.90, 0.92, None, 0.95], set=['label_smoothing=0'])])
    assert png_size(tmp_path / 'a.png') == ONE_JOB_PNG
    curves, = figure.axes
    valid = np.array([[f - 0.02, f - 0.01, f] for f in (0.90, 0.92, 0.95)]) * 100
    mean, = curves.get_lines()
    np.testing.assert_allclose(mean.get_xydata(), np.c_[[1, 2, 3], valid.mean(0)])
    assert mean.get_label() == '3 run(s): label_smoothing=0'
    band = curves.collections[0].get_paths()[0].vertices
    for epoch in (1, 2, 3):
        at = band[band[:, 0] == epoch, 1]
        assert (at.min(), at.max()) == pytest.approx((valid[:, epoch - 1].min(), valid[:, epoch - 1].max()))
    assert figure.texts[0].get_text() == 'CPU (x86_64, AVX512 kernels, 2 threads), float32'


def test_a_comparisons_picture_gives_each_job_a_colour_and_its_name(tmp_path):
    pytest.importorskip('matplotlib')                            # --plot's; CI installs it
    jobs = [drawn_job([0.90, 0.91, 0.92]), drawn_job([0.91, 0.92, 0.93], epochs=2, tiny=True)]
    figure = T.plot_jobs(tmp_path / 'ab.svg', jobs, ['A a.json, ', 'B b.json, '])
    assert (tmp_path / 'ab.svg').read_text().lstrip().startswith('<?xml')
    a, b = figure.axes[0].get_lines()
    assert a.get_color() != b.get_color() and len(b.get_xdata()) == 2
    assert [a.get_label(), b.get_label()] == ['A a.json, 3 run(s): the recipe', 'B b.json, 3 run(s): --tiny']


def test_plot_through_main_for_a_comparison_and_for_a_job_without_a_finished_run(finished_job, tmp_path,
                                                                                dataset, monkeypatch, capsys):
    """--compare A B --plot draws; Ctrl-C in run 2 draws run 1; in run 1, nothing is drawn, and said."""
    pytest.importorskip('matplotlib')                            # --plot's; CI installs it
    other = tmp_path / 'b.json'
    write_job(other, job_with(finished_job[0], [0.3, 0.4], seed=5))
    assert T.main(['--compare', str(finished_job[0]), str(other), '--plot', str(tmp_path / 'ab.png')]) == 0
    assert 'B - A: ' in capsys.readouterr().out and png_size(tmp_path / 'ab.png') == (1200, 675)  # 4.5 inches
    real = T.train_run

    def ctrl_c_at_seed_10(*args, **kwargs):                         # seed 10's; the warm-up's is 0
        if args[4] == 10:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(T, 'train_run', ctrl_c_at_seed_10)
    options = ['--tiny', '--epochs', '1', '--data-dir', str(dataset)]
    assert T.main([*options, '--seed', '9', '--runs', '2', '--plot', str(tmp_path / 'b.png')]) == 130
    assert 'runs: 1 finished' in capsys.readouterr().out and png_size(tmp_path / 'b.png') == ONE_JOB_PNG
    assert T.main([*options, '--seed', '10', '--plot', str(tmp_path / 'c.png')]) == 130
    assert f"--plot {tmp_path / 'c.png'}: no finished run to draw, nothing written" in capsys.readouterr().out
    assert not (tmp_path / 'c.png').exists()


def test_a_picture_matplotlib_cannot_write_is_said_in_one_line_after_the_job(dataset, tmp_path, monkeypatch,
                                                                              capsys):
    """.pgf through a TeX that fails (a package missing, say; matplotlib's error holds pages of TeX), an
    extension matplotlib knows not: one line, status 1, the job's file whole (--resume draws it again)."""
    pytest.importorskip('matplotlib')                            # --plot's; CI installs it
    import matplotlib
    monkeypatch.setitem(matplotlib.rcParams, 'pgf.texsystem', 'xelatex')
    (tmp_path / 'xelatex').write_text('#!/bin/sh\necho "! LaTeX Error: File underscore.sty not found."\nexit 1\n')
    (tmp_path / 'xelatex').chmod(0o755)
    monkeypatch.setenv('PATH', f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for picture in ('r.pgf', 'r.tsv'):
        job = tmp_path / f'{picture}.json'
        assert T.main([*SMALL_RUN, '--data-dir', str(dataset), '--json', str(job), '--plot', str(tmp_path / picture)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: --plot {tmp_path / picture} not drawn: ") and err.count('\n') == 1
        assert T.read_job(job, '--json')['runs_finished'] == 1 and not (tmp_path / picture).exists()


def test_plot_is_refused_before_any_work_without_matplotlib(dataset, tmp_path, monkeypatch, capsys):
    """Not installed: one line naming the install command, for a job and for --compare, before any
    work and any file."""
    monkeypatch.setattr(T.importlib.util, 'find_spec', lambda name: None if name == 'matplotlib' else pytest.fail())
    monkeypatch.setattr(T, 'pick_dtype', lambda *args: pytest.fail('work started'))
    monkeypatch.setattr(T, 'compare_lines', lambda *args: pytest.fail('work started'))
    for options in (['--tiny', '--data-dir', str(dataset), '--json', str(tmp_path / 'a.json')],
                    ['--compare', 'a.json', 'b.json']):
        assert T.main([*options, '--plot', str(tmp_path / 'a.png')]) == 1
        assert capsys.readouterr().err == (f"error: --plot '{tmp_path / 'a.png'}': needs matplotlib: pip install "
                                           'matplotlib\n')
        assert list(tmp_path.iterdir()) == []                     # no job file


def test_compare_by_hand(finished_job, tmp_path, capsys):
    """The example of test_welch_comparison_by_hand, as two jobs; B had cutout 8 and a failed run."""
    source, _ = finished_job
    a, b = tmp_path / 'a.json', tmp_path / 'b.json'
    write_job(a, job_with(source, [0.93, 0.94, 0.95]))
    hyperparameters = {**json.loads(source.read_text())['hyperparameters'], 'cutout': 8}
    write_job(b, job_with(source, [0.95, None, 0.96, 0.97], hyperparameters=hyperparameters))
    assert T.main(['--compare', str(a), str(b)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f'A  {a}: 3 runs, final accuracy (flip-TTA, EMA) mean 94.00 %, standard deviation 1.00 %',
        f'B  {b}: 3 runs (1 failed, left out), final accuracy (flip-TTA, EMA) mean 96.00 %, standard deviation 1.00 %',
        '',
        'B differs from A in: cutout (0 -> 8)',
        'B - A: +2.000 points, 95 % confidence interval [-0.267, +4.267] (Welch, 4.0 degrees of freedom), '
        'p = 0.07 (two-sided)',
        'the interval holds 0: no difference shown at the 5 % level',
        # se sqrt(2e-4 / 3) = 0.8165 points x (t_0.975,4 + t_0.8,4 = 2.7764 + 0.9410, the tables) = 3.0353
        'these runs would find a true difference of 3.035 points or more 80 % of the time at the 5 % level; with '
        'fewer than 5 runs on a side, the test rests on normally distributed accuracies, which so few cannot show']
    write_job(b, job_with(source, [0.98, 0.99, 0.97]))  # +4 points: shown, p = 0.008
    assert T.main(['--compare', str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert 'B differs from A in: nothing recorded' in out and 'B is higher than A at the 5 % level' in out
    write_job(b, job_with(source, [0.925] * 5))          # several jobs, each against A: no spread, ...
    c, d, e = tmp_path / 'c.json', tmp_path / 'd.json', tmp_path / 'e.json'
    tiny_without_ema = dict(json.loads(source.read_text())['hyperparameters'], ema_momentum=0)
    write_job(c, job_with(source, [0.94, 0.95, 0.96], hyperparameters=tiny_without_ema))
    write_job(d, job_with(source, [0.91]))                                                    # ... one run
    write_job(e, job_with(source, [0.935, 0.935]))
    assert T.main(['--compare', str(a), str(b), str(c), str(d)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == [f'A  {a}: 3 runs, final accuracy (flip-TTA, EMA) mean 94.00 %, standard deviation 1.00 %',
                       f'B  {b}: 5 runs, final accuracy (flip-TTA, EMA) mean 92.50 %, standard deviation 0.00 %',
                       f'C  {c}: 3 runs, final accuracy (flip-TTA, no EMA: the trained weights) mean 95.00 %, '
                       'standard deviation 1.00 %',
                       f'D  {d}: 1 run, final accuracy (flip-TTA, EMA) mean 91.00 %, one run']
    # B: se = sqrt(1e-4 / 3 + 0) = 0.5774 points, df = 2 (all A's), t_0.975,2 = 4.3027: -1.5 +- 2.484
    assert out[out.index('B differs from A in: nothing recorded') + 1].startswith(
        'B - A: -1.500 points, 95 % confidence interval [-3.984, +0.984] (Welch, 2.0 degrees of freedom)')
    assert out[out.index('C differs from A in: ema_momentum (0.9 -> 0)') + 1].startswith(  # A's spread: 1 +- 2.267
        'C - A: +1.000 points, 95 % confidence interval [-1.267, +3.267] (Welch, 4.0 degrees of freedom)')
    assert out[out.index('D differs from A in: nothing recorded') + 1] == (
        'D - A: -3.000 points; no test, since it needs two runs on each side')
    assert T.main(['--compare', str(b), str(e)]) == 0
    assert 'B - A: +1.000 points; no test, since both repeat one accuracy' in capsys.readouterr().out
    write_job(e, job_with(source, [0.95, 0.93, 0.94]))            # A's accuracies in another order
    assert T.main(['--compare', str(a), str(e)]) == 0             # equal means: 0 +- 2.267, p = 1
    assert ('0.000 points, 95 % confidence interval [-2.267, +2.267] (Welch, 4.0 degrees of freedom), p = 1 '
            '(two-sided)\nthe interval holds 0') in capsys.readouterr().out   # 0 up to a sum's rounding, +-
    assert T.main(['--compare', str(a), str(tmp_path / 'missing.json')]) == 1
    assert capsys.readouterr().err == f"error: --compare {tmp_path / 'missing.json'}: no such file\n"
    assert T.main(['--compare', str(a)]) == 0                     # one job: its accuracies
    assert capsys.readouterr().out.startswith(f'A  {a}: 3 runs, final accuracy')


def edited(change):
    """A job file's text as change(job) leaves it, its sha256 as it was."""
    def text(source):
        job = json.loads(source)
        change(job)
        return json.dumps(job, indent=1)
    return text


@pytest.mark.parametrize('damage', [
    lambda text: text[:len(text) // 2], lambda text: '{"runs": []}', lambda text: '[1, 2, 3]',  # cut, foreign
    edited(lambda job: job.pop('format')),                                               # an older version's
    edited(lambda job: job['runs'][0].update(accuracy='0.5')), edited(lambda job: job['runs'].append(job['runs'][1])),
    edited(lambda job: job.update(seeds=job.pop('seed')))])
def test_an_edited_or_older_job_file_is_refused_whole_in_one_line_and_kept(finished_job, tmp_path, monkeypatch,
                                                                          capsys, damage):
    """A wrong type once let --resume train a run and crash before writing it; a file cut short, of
    another kind, of an older version, or edited by hand is now refused before any work by --resume
    and --compare (--json refuses any file that exists: test_json_on_a_job_file_refuses_to_overwrite_it)."""
    source, options = finished_job
    path = tmp_path / 'job.json'
    path.write_text(damage(source.read_text()))
    text = path.read_bytes()
    no_training(monkeypatch)
    monkeypatch.setattr(T, 'pick_dtype', lambda *args: pytest.fail('work started'))
    for argv, option in (([*options, '--runs', '3', '--resume', str(path)], '--resume'),
                         (['--compare', str(source), str(path)], '--compare')):
        assert T.main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err == (f'error: {option} {path} is not a job file as this version of train_cifar10.py wrote it '
                       "(another file, an older version's, cut short, or changed since by hand or damage); "
                       'left as it is')
        assert path.read_bytes() == text


@pytest.mark.parametrize('changes, accuracies, message', [
    (dict(data_digest='0000000000000000'), [0.95, 0.96], 'tested on different data, data_digest \\(\\w+ -> 0000'),
    (dict(test_images=123), [0.95, 0.96], 'tested on different data, test_images \\(200 -> 123\\), so their'),
    (dict(data='official CIFAR-10'), [0.95, 0.96], 'tested on different data, data \\(NOT the .* -> official'),
    ({}, [None, None], 'has no finished run'),
])
def test_compare_refuses_what_cannot_be_compared_in_one_line(finished_job, tmp_path, capsys, changes, accuracies,
                                                             message):
    source, _ = finished_job
    a, b = tmp_path / 'a.json', tmp_path / 'b.json'
    write_job(a, job_with(source, [0.93, 0.94, 0.95]))
    write_job(b, job_with(source, accuracies, **changes))
    assert T.main(['--compare', str(a), str(b)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith('error: --compare') and re.search(message, err) and '\n' not in err
    b.write_text(b.read_text()[:100])
    assert T.main(['--compare', str(a), str(b)]) == 1
    assert f'error: --compare {b} is not a job file as this version' in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# A job file is never lost or misread
# ---------------------------------------------------------------------------------------------
def copy_of(source, tmp_path, name='job.json'):
    """A copy of a job's file; returns its path and bytes."""
    path = tmp_path / name
    shutil.copy(source, path)
    return path, path.read_bytes()


def test_json_on_a_job_file_refuses_to_overwrite_it(finished_job, tmp_path, monkeypatch, capsys):
    """Running the first command again after a crash, instead of --resume, must not lose the job;
    nor may a new job overwrite any other file."""
    path, text = copy_of(finished_job[0], tmp_path)
    notes = tmp_path / 'notes.json'
    notes.write_text('my notes')
    no_training(monkeypatch)
    monkeypatch.setattr(T, 'pick_dtype', lambda *args: pytest.fail('work started'))
    for file in (path, notes):
        assert T.main([*finished_job[1], '--runs', '4', '--json', str(file)]) == 1
        assert capsys.readouterr().err == (f"error: --json '{file}': exists, and a new job overwrites no file: "
                                           'give another path, or --resume its job\n')
    assert path.read_bytes() == text and notes.read_text() == 'my notes'


def test_every_setting_that_changes_a_runs_numbers_is_part_of_the_job(finished_job, tmp_path, monkeypatch,
                                                                      capsys):
    """The job was trained eager (--tiny's default): a resumed --compile would mix compiled runs
    into it. Another CPU kernel set rounds differently too."""
    source, options = finished_job
    path, text = copy_of(source, tmp_path)
    no_training(monkeypatch)
    assert T.main([*options, '--runs', '3', '--compile', '--resume', str(path)]) == 1
    assert 'differs from this one in compile (False -> default)' in capsys.readouterr().err
    threads = torch.get_num_threads()
    with monkeypatch.context() as patch:
        patch.setattr(torch, 'get_num_threads', lambda: threads + 1)
        assert T.main([*options, '--runs', '3', '--resume', str(path)]) == 1
    assert re.search(rf"device \(CPU .*\b{threads} threads?\) -> CPU \(.*\b{threads + 1} threads\)\), that job's -> "
                     r"this one's: resume it", capsys.readouterr().err)
    other = next(c for c in ('AVX512', 'AVX2') if c != torch.backends.cpu.get_cpu_capability())
    monkeypatch.setattr(torch.backends.cpu, 'get_cpu_capability', lambda: other)  # not the job's
    assert T.main([*options, '--runs', '3', '--resume', str(path)]) == 1
    assert re.search(rf'-> CPU \([^,]+, {other}\b', capsys.readouterr().err)
    job = json.loads(text)
    assert job['compile'] is False and 'kernels' in job['device']
    assert path.read_bytes() == text


def test_a_refusal_shows_each_differing_value_whole():
    """A CPU's description under another kernel set runs past 40 characters, and where two
    machines' differ is its end (the threads): nothing is cut."""
    cpu = 'CPU (x86_64, DEFAULT, oneDNN up to SSE41 kernels, {} threads)'
    a, b = dict(device=cpu.format(3), seed=None), dict(device=cpu.format(2), seed=0)
    assert T.job_differences(a, b, ('device', 'seed')) == [
        f'device ({cpu.format(3)} -> {cpu.format(2)})', 'seed (unset -> 0)']


def test_resume_takes_the_jobs_options_from_its_file(finished_job, tmp_path, monkeypatch, capsys):
    """--resume alone goes on with the options the job was given (--tiny, --epochs, --data-dir, ...);
    one typed beside it wins: --runs 3 adds a run, --set cutout=8 would change the job and is refused.
    --runs given at a resume is the job's from its first finished run on."""
    source, options = finished_job
    path, text = copy_of(source, tmp_path)
    monkeypatch.chdir(tmp_path)                                   # no ./data here: the file's --data-dir
    assert T.main(['--resume', str(path), '--set', 'cutout=8']) == 1
    err = capsys.readouterr().err
    assert err.count('cutout (0 -> 8)') == 1 and 'None' not in err and path.read_bytes() == text
    assert err.endswith("that job's -> this one's: resume it with the script, kind of device and options it "
                        'began with, or give a new job its own --json\n')

    assert T.main(['--resume', str(path), '--runs', '3']) == 0
    job = T.read_job(path, '--resume')
    assert [run['run'] for run in job['runs']] == [1, 2, 3] and len(job['runs'][2]['rows']) == 1
    assert job['options']['data_dir'] == options[options.index('--data-dir') + 1] and job['options']['tiny']


def test_compare_says_what_a_side_lacks_and_trains_nothing(finished_job, tmp_path, capsys):
    source, _ = finished_job
    a, b = tmp_path / 'a.json', tmp_path / 'b.json'
    write_job(a, job_with(source, [0.93, 0.94, 0.95]))
    write_job(b, job_with(source, [0.95, 0.96], runs_requested=4, compile=True))
    assert T.main(['--compare', str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert f'B  {b}: 2 runs, final accuracy' in out
    assert 'B differs from A in: compile (False -> True)' in out


@pytest.mark.parametrize('argv, message', [
    (['--resume', '{tmp}'], "error: --resume '{tmp}': a folder or nothing (an unset shell variable?): give a file name"),
    (['--json', ''], "error: --json '': a folder or nothing (an unset shell variable?): give a file name"),
    (['--resume', ''], "error: --resume '': a folder or nothing (an unset shell variable?): give a file name"),
])
def test_a_mistaken_path_gets_one_line(dataset, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(T, 'pick_dtype', lambda *args: pytest.fail('work started'))
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert T.main(['--tiny', '--data-dir', str(dataset), *argv]) == 1
    assert capsys.readouterr().err.strip() == message.format(tmp=tmp_path)
    assert not (tmp_path / 'r.json').exists()


@pytest.mark.parametrize('option, path, message', [
    ('--json', 'missing/r.json', r'its folder .*/missing is missing or not writable$'),
    ('--plot', 'a_file/r.png', r'its folder .*/a_file is missing or not writable$'),
    ('--save', '.', "': a folder or nothing"),
    ('--save', 'a_file', "': exists, and a new job overwrites no file: give another path, or --resume its job$"),
    ('--plot', '.', "': a folder or nothing"),
])
def test_output_paths_are_refused_before_any_work(dataset, tmp_path, monkeypatch, capsys, option, path, message):
    """Each file is written after every run: a path it cannot be written to would cost the runs."""
    (tmp_path / 'a_file').write_text('')
    monkeypatch.setattr(T, 'pick_dtype', lambda *args: pytest.fail('work started'))
    assert T.main(['--tiny', '--data-dir', str(dataset), option, str(tmp_path / path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f'error: {option} ') and re.search(message, err) and '\n' not in err


def test_main_returns_the_status_of_a_usage_error_or_help(capsys):
    """A mistyped option gets one line, as every other mistake does, and a usage error's status."""
    assert T.main(['--epoch', '1']) == 2                            # no abbreviations of options
    assert capsys.readouterr().err == ('error: unrecognized arguments: --epoch 1; '
                                       '--help lists the options\n')
    assert T.main(['--dtype', 'fp8']) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --dtype: invalid choice: 'fp8'") and err.count('\n') == 1
    assert T.main(['--help']) == 0
    assert '--data-dir' in capsys.readouterr().out


def test_pasted_into_a_notebook_cell(dataset, tmp_path):
    """Colab runs a cell with the kernel's argv and no __file__; main() in a later cell works."""
    (tmp_path / 'data' / T.BATCHES_DIR).mkdir(parents=True)       # ./data: present but empty
    cell = f"""
import sys
sys.argv = ['/usr/local/lib/python3/dist-packages/colab_kernel_launcher.py', '-f', '/root/kernel-1.json']
namespace = {{'__name__': '__main__'}}
exec(compile(open({str(SCRIPT)!r}).read(), '<cell>', 'exec'), namespace)   # cell 1: the pasted file
print('cell 1 done')
status = namespace['main'](['--tiny', '--data-dir', {str(dataset)!r}, '--epochs', '1'])  # cell 2
print('cell 2 status', status)
"""
    result = subprocess.run([sys.executable, '-c', cell], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    # cell 1 parsed no arguments (the defaults: ./data), failed on the empty folder, raised nothing
    assert 'unrecognized arguments' not in result.stderr and 'Traceback' not in result.stderr
    assert f"data/{T.BATCHES_DIR}/data_batch_1: not a CIFAR-10 python batch (No such file" in result.stderr
    assert 'cell 1 done' in result.stdout
    assert 'cell 2 status 0' in result.stdout and 'train_cifar10.py n/a' in result.stdout


# ---------------------------------------------------------------------------------------------
# Speed: compilation (in channels_last) changes nothing but the speed
# ---------------------------------------------------------------------------------------------
COMPILE_WORKER = """
import copy, os, sys, torch
os.nice(19)                                       # cores the other tests leave idle, not theirs
sys.path.insert(0, {repo!r})
import train_cifar10 as T
torch.set_num_threads(1)                          # two workers share the two cores
data = T.load_cifar10(T.ensure_cifar10({data!r}))
data = {{k: v[:64] if k.startswith('train') else v for k, v in data.items()}}   # 1 step of --tiny, see below
hyp = {{**T.HYP, **T.TINY, 'epochs': 1}}
graphs = torch._dynamo.utils.counters['stats']             # what dynamo compiled, counted
counts = {{}}
callers = torch.compile(lambda x: x * 2 + 1)      # a function of the caller's, compiled before any run
callers(torch.ones(3))
for name, compile in [('eager_nchw', False), ('compiled', 'default')]:   # through the Python entry
    before = graphs['unique_graphs']
    model, rows = T.train(data, hyp, seed=0, device='cpu', compile=compile)
    trainer = list(T.TRAINERS.values())[-1]       # the one used last
    counts[name] = graphs['unique_graphs'] - before
    torch.save(dict(rows=rows, net=copy.deepcopy(trainer.network.state_dict()), ema=model.state_dict()),
               f'{out}/{{name}}.pt')
warm_up, T.warmed_up_trainer = T.warmed_up_trainer, None   # from here, a warm-up or a check would fail
before = graphs['unique_graphs']
for lr_peak in (0.5, 1.0, 2.0):                   # a sweep of settings that enter no graph
    for epochs in (1, 2):
        T.train(data, {{**hyp, 'lr_peak': lr_peak, 'epochs': epochs}}, seed=1, device='cpu', compile='default')
counts['sweep'] = graphs['unique_graphs'] - before
T.warmed_up_trainer = warm_up
torch._dynamo.config.recompile_limit = 1          # torch's limit, held to one graph per function ...
other = {{**hyp, 'channels': (8, 16, 32, 32)}}      # ... which this second graph setting would pass
print('second setting: start', file=sys.stderr, flush=True)
before = graphs['unique_graphs']
T.train(data, other, device='cpu', compile='default')
counts['other'] = graphs['unique_graphs'] - before
print('second setting: end', file=sys.stderr, flush=True)
T.warmed_up_trainer, before = None, graphs['unique_graphs']
for settings in (hyp, other, hyp, other):         # A, B, A, B: both kept, none compiled again
    T.train(data, settings, device='cpu', compile='default')
before_callers = graphs['unique_graphs']
callers(torch.ones(3))                            # compiled before train(): not compiled again
counts.update(again=before_callers - before, callers=graphs['unique_graphs'] - before_callers,
              trainers=len(T.TRAINERS))
torch.save(counts, f'{out}/counts.pt')
wide = T.Trainer(hyp, torch.device('cpu'), torch.float64, False)   # the same run in float64: a reference
first = T.first_images(data, hyp)
rows = T.train_run(first, T.upload_test_set(first, wide), wide, hyp, 0, T.print_nothing)
torch.save(dict(rows=rows, net=wide.network.state_dict(), ema=wide.ema.state_dict()), f'{out}/float64.pt')
"""


HALF_PRECISION_WORKER = """
import copy, os, sys, torch
os.nice(19)                                       # cores the other tests leave idle, not theirs
sys.path.insert(0, {repo!r})
import train_cifar10 as T
torch.set_num_threads(1)                          # two workers share the two cores
dtype, cpu = getattr(torch, {dtype!r}), torch.device('cpu')
data = T.load_cifar10(T.ensure_cifar10({data!r}))
hyp = {{**T.HYP, **T.TINY}}
said = []                                         # the warm-up's lines: the GPU's mode, CUDA graphs
networks = T.warmed_up_trainer(T.first_images(data, hyp), hyp, cpu, dtype, 'reduce-overhead',
                               lambda line, **options: said.append(line))
networks.new_run(hyp, 0, T.whitening_filters(T.upload_normalised(data['train_images'], cpu, torch.float32), 1e-2))
x = T.upload_normalised(data['train_images'][:64], cpu, dtype).contiguous(memory_format=torch.channels_last)
y = torch.from_numpy(data['train_labels'][:64])
disagreement = T.compiled_step_error(networks, x, y, hyp)   # leaves the compiled step's gradients
compiled = {{n: p.grad.clone() for n, p in networks.network.named_parameters() if p.requires_grad}}
networks.network.zero_grad()
T.summed_loss(networks.network, x, y, hyp['label_smoothing'])[0].backward()
eager = {{n: p.grad.clone() for n, p in networks.network.named_parameters() if p.requires_grad}}
wide = copy.deepcopy(networks.network).double()   # the same weights and images, in fp64: the gradients' scale
T.summed_loss(wide, x.double(), y, hyp['label_smoothing'])[0].backward()
reference = {{n: p.grad.clone() for n, p in wide.named_parameters() if p.requires_grad}}
networks.new_run(hyp, 0, networks.ema.prep[0].whitening.clone())
losses = [T.summed_loss(networks.network, x, y, hyp['label_smoothing'])[0].item() / 64]
batches = x.repeat(5, 1, 1, 1).contiguous(memory_format=torch.channels_last), y.repeat(5)
for epoch in range(3):                            # a learnable task: 3 epochs of 5 steps on one batch
    T.train_epoch(networks, *batches, T.lr_schedule({{**hyp, 'epochs': 3}}, [(5 * epoch + i) / 5 for i in range(1, 6)]).tolist(), hyp)
losses.append(T.summed_loss(networks.network, x, y, hyp['label_smoothing'])[0].item() / 64)
test = T.upload_normalised(data['test_images'], cpu, dtype).contiguous(memory_format=torch.channels_last)
evaluation = T.evaluate(networks, test, torch.from_numpy(data['test_labels']), hyp)
whitening_kept = torch.equal(networks.ema.prep[0].whitening, networks.network.prep[0].whitening)
torch.save(dict(disagreement=disagreement, compiled=compiled, eager=eager, reference=reference, losses=losses, evaluation=evaluation,
                whitening_kept=whitening_kept, said=said,
                net={{n: t.dtype for n, t in networks.network.state_dict().items()}},
                ema={{n: t.dtype for n, t in networks.ema.state_dict().items()}}), {out!r} + '/run.pt')
"""


@pytest.fixture(scope='session', autouse=True)
def compile_workers(request, dataset, tmp_path_factory):
    """The workers of compiled_runs, started with the suite when a selected test needs them: each
    spends most of a minute compiling, on one core, at the lowest priority: in the time the other
    tests leave (competing with them, the suite took more CPU time, not less)."""
    workers = {}
    if not any('compiled_runs' in item.fixturenames for item in request.session.items):
        yield workers
        return
    folder = tmp_path_factory.mktemp('compiled')
    for dtype in ('float32', 'float16'):
        out = folder / dtype
        out.mkdir()
        worker = COMPILE_WORKER if dtype == 'float32' else HALF_PRECISION_WORKER
        script = out / 'worker.py'
        script.write_text(worker.format(repo=str(SCRIPT.parent), data=str(dataset), dtype=dtype, out=str(out)))
        with open(out / 'stderr', 'w') as stderr:  # a file: a full pipe would stop the worker
            workers[dtype] = out, subprocess.Popen(
                [sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=stderr,
                env={**os.environ, 'TORCH_LOGS': 'recompiles'})
    yield workers
    for _, worker in workers.values():
        worker.kill()  # if the suite stopped before it was waited for
        worker.wait()


@pytest.fixture(scope='module')
def compiled_runs(compile_workers):
    """What compiled training gives on the CPU, narrow: fp32 (COMPILE_WORKER, beside eager, with
    torch's recompile log), and the GPU's default path, fp16 in torch.compile's mode for CUDA
    graphs (HALF_PRECISION_WORKER).
    dtype -> (the folder of its results, its stderr)."""
    results = {}
    for dtype, (folder, worker) in compile_workers.items():
        worker.wait()                                             # however long a loaded machine takes
        stderr = (folder / 'stderr').read_text()
        assert worker.returncode == 0, stderr
        results[dtype] = folder, stderr
    return results


def test_compiled_and_channels_last_training_equals_eager_nchw_and_never_recompiles(compiled_runs):
    """The first step of --tiny (loss, weights, batch-norm statistics, EMA, evaluation) gives the same
    numbers compiled by inductor, in channels_last, and eager in NCHW, both through train() from
    Python, up to fp32's rounding. One step, not more: after a second step a near-tie flipped in
    max-pooling can send a gradient to another pixel.
    Each tensor after the step is compared with the same run in float64: the compiled one may be at
    most 4 times as far from it as eager's, and at least 4 x 256 x 2^-24 of the tensor's norm. 256 x
    2^-24 = 1.5e-5 is fp32's rounding of a sum of the step's largest size, 64 x 32 x 32 = 65,536 terms,
    taken in another order (a random walk: sqrt(n) units); a tensor that is itself a cancelling sum, as
    a batch-norm bias's step is, is further: 2.3e-4 from float64 eager and under AVX-512 compiled,
    6e-6 compiled under SSE4.1's kernels (measured, torch 2.13). A loss, a sum over the images of a
    forward pass of such sums, takes 1e-4 of itself; an accuracy may differ by one near-tie image:
    1/64 of the training batch, 1/200 of the test images."""
    folder, stderr = compiled_runs['float32']
    outside = stderr.split('second setting: start')[0] + stderr.split('second setting: end')[1]
    assert 'Recompiling' not in outside                           # but for the second graph setting's graphs
    reference = torch.load(folder / 'eager_nchw.pt')
    other = torch.load(folder / 'compiled.pt')
    for key in ('train_loss', 'valid_loss'):
        assert other['rows'][0][key] == pytest.approx(reference['rows'][0][key], rel=1e-4)
    for key, images in (('train_acc', 64), ('valid_acc', 200)):
        assert other['rows'][0][key] == pytest.approx(reference['rows'][0][key], abs=1 / images + 1e-9)
    exact = torch.load(folder / 'float64.pt')
    for model in ('net', 'ema'):                                  # weights and batch-norm statistics
        for k, v in exact[model].items():
            if v.is_floating_point():
                eager, compiled = (float((run[model][k].double() - v).norm()) for run in (reference, other))
                assert compiled <= 4 * max(eager, 256 * 2 ** -24 * float(v.norm())), (model, k, compiled, eager)


def test_a_sweep_compiles_each_graph_once_and_leaves_the_callers_compiled_code(compiled_runs):
    """Counted with dynamo's own count of the graphs it compiled, in COMPILE_WORKER: eager compiles
    nothing; the first compiled call compiles the training step and the evaluation pass; a sweep of
    lr_peak x 3 and epochs x 2 compiles nothing more and neither checks nor warms up again; a second
    graph setting compiles its own two graphs although torch's limit is held to one graph per
    function; then A, B, A, B compiles nothing; and a function the caller compiled before train()
    is not compiled again after it."""
    counts = torch.load(compiled_runs['float32'][0] / 'counts.pt')
    assert counts['eager_nchw'] == 0 and counts['compiled'] == counts['other'] == 2
    assert counts['sweep'] == counts['again'] == counts['callers'] == 0 and counts['trainers'] == 3  # eager's too


@pytest.mark.parametrize('dtype', ['float16'])
def test_the_gpu_default_compiled_half_precision_trains_as_eager(compiled_runs, dtype):
    """A GPU trains in fp16, compiled, by default: the same path here, narrow, on the CPU. The
    compiled step's gradients are finite and point where eager's do (the check of the start-up
    finds them equal within the dtype's rounding), the weights are half precision but batch
    norm's, the EMA and its evaluation are fp32, and 15 steps on one batch learn it.
    With amax as the global pool, inductor's backward gave NaN to every gradient below the head,
    in fp16."""
    run = torch.load(compiled_runs[dtype][0] / 'run.pt')
    assert run['disagreement'] is None
    # Their scale, whatever the check says: the norm of all the gradients, compiled and eager,
    # against fp64's on the same weights and images. fp16 rounds each value it stores by up to
    # 2^-11 of itself, and a gradient passes at most 9 stored stages back from the loss (head,
    # 7 convolutions, prep): 9 x 2^-11 = 0.44 % of each element, hence of the norm (measured:
    # 0.06 % compiled, 0.01 % eager; a single batch-norm bias's sum over its cancelling terms can
    # be 3 % off, the whole norm not).
    def norm(grads):
        return math.sqrt(sum(float(g.double().norm()) ** 2 for g in grads.values()))
    for path in ('compiled', 'eager'):
        assert norm(run[path]) == pytest.approx(norm(run['reference']), rel=9 * 2 ** -11), path
    for name, compiled in run['compiled'].items():
        eager = run['eager'][name]
        assert torch.isfinite(compiled).all() and compiled.abs().sum() > 0, name
        assert F.cosine_similarity(compiled.double().flatten(), eager.double().flatten(), dim=0) > 0.8, name
    batch_norms = {name.rsplit('.', 1)[0] for name in run['net'] if name.endswith('.running_mean')}
    for name, t in run['net'].items():                            # weights, buffers, BN statistics
        wide = name.rsplit('.', 1)[0] in batch_norms or name == 'prep.0.whitening'
        if not name.endswith('num_batches_tracked'):
            assert t == (torch.float32 if wide else getattr(torch, dtype)), name
    assert set(run['ema'].values()) == {torch.float32, torch.int64} and run['whitening_kept']
    assert [t.dtype for t in run['evaluation'][:2]] == [torch.float32, torch.int64]    # summed loss, correct count
    before, after = run['losses']                                # the batch's mean loss
    assert torch.isfinite(run['evaluation'][0]) and after < 0.8 * before


class ScaledGradient(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by a factor (a compiler's fault)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def compiles_wrongly(factor):
    """A torch.compile whose training step has the right loss but every gradient times factor."""
    def compile(function, **options):
        if function is not T.summed_loss:
            return function
        def step(model, images, labels, label_smoothing):
            loss, logits = function(model, images, labels, label_smoothing)
            return ScaledGradient.apply(loss, factor), logits
        return step
    return compile


@pytest.mark.parametrize('factor, what', [(math.nan, "prep.0.weight's gradient differs from eager's by nan of its size"),
                                          (0.0, "prep.0.weight's gradient differs from eager's by 1 of its size"),
                                          (2.0, "prep.0.weight's gradient differs from eager's by 1 of its size")])
def test_a_compiled_step_that_disagrees_with_eager_stops_the_job_in_one_line(dataset, monkeypatch, capsys, factor, what):
    """A NaN raises nothing: the start-up check compares the compiled step with eager's, before any run."""
    monkeypatch.setattr(T.torch, 'compile', compiles_wrongly(factor))
    assert T.main(['--tiny', '--compile', '--epochs', '1', '--data-dir', str(dataset)]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f'error: torch.compile computes a wrong step ({what}, beyond the ') and err.count('\n') == 1
    assert err.endswith('its rounding allows); --no-compile trains eager\n') and 'run 1/1' not in out


def test_the_check_passes_a_correct_compiled_step_and_names_a_wrong_loss(monkeypatch):
    """With the eager function in place of the compiled one, nothing disagrees; a loss 1 % off does."""
    networks, hyp = small_networks({'batch_size': 64})
    x, y = torch.randn(64, 3, 32, 32), torch.arange(64) % 10
    assert T.compiled_step_error(networks, x, y, hyp) is None
    networks.loss = lambda *args: (lambda loss, logits: (loss * 1.01, logits))(*T.summed_loss(*args))
    assert "(the loss differs from eager's by 0.01 of its size" in T.compiled_step_error(networks, x, y, hyp)


def compiler_failure(inner):
    """What torch.compile raises when its backend fails: an InductorError wrapping the cause."""
    from torch._inductor.exc import InductorError
    return InductorError(inner, None)


def test_a_damaged_compile_cache_is_named_in_the_one_line(dataset, monkeypatch, capsys):
    """Ctrl-C during a compilation can leave a truncated library in torch's cache, which the next
    compilation fails to load: the one line gives the root cause, which names the file."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    damaged = f'{cache_dir()}/uf/cufdeo2.main.so'

    def compiled_step_error(*args):
        raise compiler_failure(ImportError(f'{damaged}: file too short'))
    monkeypatch.setattr(T, 'compiled_step_error', compiled_step_error)
    assert T.main(['--tiny', '--compile', '--epochs', '1', '--data-dir', str(dataset)]) == 1
    assert capsys.readouterr().err == (f'error: torch.compile failed (ImportError: {damaged}: file too short); '
                                       '--no-compile trains eager\n')


def test_a_machine_without_a_cpp_compiler_is_told_in_one_line(dataset):
    """Inductor's CPU kernels need a C++ compiler: a machine without one gets the reason and the way out."""
    result = run_script('--tiny', '--compile', '--epochs', '1', '--data-dir', str(dataset),
                        env={**os.environ, 'CXX': '/nonexistent/g++'})
    assert result.returncode == 1 and 'Traceback' not in result.stderr
    assert result.stderr.startswith('error: torch.compile failed (') and 'C++ compiler' in result.stderr
    assert result.stderr.endswith('; --no-compile trains eager\n') and result.stderr.count('\n') == 1


# ---------------------------------------------------------------------------------------------
# A real copy of CIFAR-10, when CIFAR10_DIR points at one
# ---------------------------------------------------------------------------------------------
CIFAR10_DIR = os.environ.get('CIFAR10_DIR')
needs_cifar10 = pytest.mark.skipif(not CIFAR10_DIR, reason='set CIFAR10_DIR to a folder holding cifar-10-batches-py/')


@needs_cifar10
def test_real_copy_has_the_official_counts():
    data = T.load_cifar10(T.ensure_cifar10(CIFAR10_DIR))
    assert data['train_images'].shape == (50000, 3, 32, 32) and data['test_images'].shape == (10000, 3, 32, 32)
    assert np.bincount(data['train_labels']).tolist() == [5000] * 10
    assert np.bincount(data['test_labels']).tolist() == [1000] * 10
    means = data['train_images'].reshape(50000, 3, -1).mean(axis=(0, 2))
    np.testing.assert_allclose(means, T.CIFAR10_MEAN, atol=0.5)  # Page's published channel means


# ---------------------------------------------------------------------------------------------
# The runs of a job in one process, to compare with a job that was stopped and resumed
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def one_thread():
    """torch's threads set to 1 for a block, as OMP_NUM_THREADS=1 sets them for a process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope='module')
def one_process_job(dataset, tmp_path_factory):
    """A 4-run --tiny job of one epoch in one process, one thread: the runs to expect."""
    path = tmp_path_factory.mktemp('one') / 'r.json'
    with one_thread(), contextlib.redirect_stdout(io.StringIO()):
        assert T.main(['--tiny', '--epochs', '1', '--runs', '4', '--data-dir', str(dataset), '--json', str(path)]) == 0
    return T.read_job(path, '--json')


# ---------------------------------------------------------------------------------------------
# Benchmark, not a test: BENCHMARK=1 runs it (README: "Speed"), CI skips it
# ---------------------------------------------------------------------------------------------
# What David Page's cifar10-fast needs to run on today's PyTorch and NumPy, applied as his modules
# are loaded; each must apply, or the checkout is not the one these were written for.
PAGE_PATCHES = {
    'core': [('isinstance(val, (float, np.float))', 'isinstance(val, float)')],
    'torch_backend': [('dw.add_(weight_decay, w).mul_(-lr)', 'dw.add_(w, alpha=weight_decay).mul_(-lr)'),
                      ('w.add_(dw.add_(momentum, v))', 'w.add_(dw.add_(v, alpha=momentum))'),
                      ('.astype(np.float)', '.astype(np.float64)'),
                      ('Λ, V = torch.symeig(Σ, eigenvectors=True)', 'Λ, V = torch.linalg.eigh(Σ)')],
    'new_dawn': [('\nmain()', '\n')],                                 # a module to import, not a script to run
}


def load_page_code(folder):
    """Page's core, torch_backend, dawn_utils and new_dawn modules from a checkout of his repository."""
    try:
        import pandas  # noqa: F401
    except ImportError:                                           # only his notebook tables use it
        sys.modules['pandas'] = types.ModuleType('pandas')
        sys.modules['pandas'].__spec__ = importlib.machinery.ModuleSpec('pandas', None)  # torch.compile asks
    modules = {}
    for name in ('core', 'torch_backend', 'dawn_utils', 'new_dawn'):
        source = (folder / f'{name}.py').read_text()
        for old, new in PAGE_PATCHES.get(name, []):
            assert source.count(old) == 1, f'{name}.py: cannot apply the patch {old!r}'
            source = source.replace(old, new)
        module = sys.modules[name] = types.ModuleType(name)
        exec(compile(source, str(folder / f'{name}.py'), 'exec'), module.__dict__)
        modules[name] = module
    return modules


def page_step(page, device, dtype, batch_size):
    """One step of Page's final recipe, as new_dawn.py builds and trains it: forward, loss, backward,
    his two SGD groups, and his EMA (which fires on the first batch it sees, as ours does)."""
    tb, nd = page['torch_backend'], page['new_dawn']
    Λ, V = tb.eigens(tb.patches(torch.randn(1000, 3, 32, 32)))
    model = tb.Network(page['dawn_utils'].net(weight=1 / 16, conv_bn=nd.conv_bn,
                                              prep=partial(nd.whitening_block, Λ=Λ.to(device), V=V.to(device)))).to(device)
    if dtype == torch.float16:
        model = model.half()
    is_bias = tb.group_by_key(('bias' in k, v) for k, v in tb.trainable_params(model).items())
    schedule = {'momentum': tb.Const(0.9)}
    opts = [tb.SGD(is_bias[False], {**schedule, 'lr': lambda step: 0.5 / batch_size, 'weight_decay': tb.Const(5e-4 * batch_size)}),
            tb.SGD(is_bias[True], {**schedule, 'lr': lambda step: 0.5 * 64 / batch_size,
                                   'weight_decay': tb.Const(5e-4 * batch_size / 64)})]
    state = {tb.MODEL: model, tb.VALID_MODEL: T.copy.deepcopy(model), tb.LOSS: tb.label_smoothing_loss(0.2), tb.OPTS: opts}
    return lambda x, y: tb.reduce([{'input': x, 'target': y}], state,
                                  (*tb.default_train_steps, tb.update_ema(momentum=0.99, update_freq=5)))


def our_steps(device, dtype, compiled, hyp):
    """train_epoch over the given batches, on networks built as main builds them, with the given
    speed settings."""
    networks = T.Trainer(hyp, device, dtype, compiled)
    networks.new_run(hyp, 0, torch.randn(27, 3, 3, 3))
    layout = networks.memory_format
    return lambda x, y, steps: T.train_epoch(networks, x.contiguous(memory_format=layout), y, [0.5] * steps, hyp)


def page_steps(page, device, dtype, batch_size):
    step = page_step(page, device, dtype, batch_size)
    return lambda x, y, steps: [step(x[i * batch_size:(i + 1) * batch_size], y[i * batch_size:(i + 1) * batch_size])
                                for i in range(steps)]


@pytest.mark.skipif(not os.environ.get('BENCHMARK'), reason='a benchmark: BENCHMARK=1 runs it')
def test_benchmark_full_width_training_steps():
    """Throughput of full-width training steps at batch 512 for each speed setting of this script,
    and for Page's own code when PAGE_CODE names a checkout of davidcpage/cifar10-fast: in one
    process, after a warm-up (compilation, cuDNN's search), BENCHMARK_STEPS steps (default 50) timed
    between two device syncs, the settings interleaved, BENCHMARK_REPS times (default 3). The
    device is BENCHMARK_DEVICE (default cpu); the dtype is the script's default for it."""
    device = torch.device(os.environ.get('BENCHMARK_DEVICE', 'cpu'))
    dtype = torch.float16 if device.type == 'cuda' else torch.float32
    n_steps, batch = int(os.environ.get('BENCHMARK_STEPS', 50)), 512
    hyp = dict(T.HYP)
    default = T.pick_compile_mode(None, device)                        # CUDA graphs on a GPU
    steps = {'eager (NCHW)': our_steps(device, dtype, False, hyp),
             f'compiled ({default}), the default': our_steps(device, dtype, default, hyp)}
    if os.environ.get('PAGE_CODE'):
        steps["Page's cifar10-fast"] = page_steps(load_page_code(Path(os.environ['PAGE_CODE'])), device, dtype, batch)
    x = torch.randn(n_steps * batch, 3, 32, 32, device=device, dtype=dtype)     # distinct batches
    y = torch.randint(0, 10, (n_steps * batch,), device=device)
    for step in steps.values():                                   # warm-up: compilation, cuDNN's search
        step(x, y, min(2, n_steps))
    times = {name: [] for name in steps}
    for _ in range(int(os.environ.get('BENCHMARK_REPS', 3))):
        for name, step in steps.items():
            start = T.synced_clock(device)
            step(x, y, n_steps)
            times[name].append((T.synced_clock(device) - start) / n_steps)
    page = np.median(times["Page's cifar10-fast"]) if "Page's cifar10-fast" in times else None
    print(f'\n{n_steps} training steps between syncs, batch {batch}, {T.device_description(device)}, {dtype}, '
          f'torch {torch.__version__}; median of {len(next(iter(times.values())))} interleaved repetitions')
    print(f"{'setting':40} {'ms/step':>9} {'images/s':>9}  {'ms/step of each repetition':28} {'Page / this':>11}")
    for name, t in times.items():
        ratio = f'{page / np.median(t):11.2f}' if page else ''
        each = ' '.join(f'{1000 * s:.1f}' for s in t)
        print(f"{name:40} {1000 * np.median(t):9.1f} {batch / np.median(t):9.0f}  {each:28} {ratio}")
