"""David Page's recipe for 94% on CIFAR-10 in 10 epochs (a ResNet9), in one file.

    python train_cifar10.py --tiny                                # an install check, seconds
    python train_cifar10.py --epochs 10 --runs 50 --json a.json   # the recipe 50 times, a summary
    python train_cifar10.py --resume a.json                       # the same job, resumed
    python train_cifar10.py --runs 50 --set label_smoothing=0.1 --json b.json    # a variant
    python train_cifar10.py --compare a.json b.json               # is the variant better?

The final recipe of David Page's "How to train your ResNet" (Myrtle.ai, 2018-19), 94.1% mean
test accuracy in 10 epochs, 26 s on a V100: a ResNet9 that first whitens 3x3 patches, ghost batch
norm, CELU, fp16 with fp32 batch norm, label smoothing, Nesterov SGD on a piecewise-linear
schedule, an EMA of the weights, flip test-time augmentation. Below: the recipe, then the harness.
"""
import copy, math, time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ==== Hyperparameters ==========================================================================
# David Page's final 10-epoch recipe, from "How to train your ResNet 8: bag of tricks" (Page 8).
# Its gains below, 94.1 -> X %, are means of 50 runs at the epochs of their day, which Page then
# cut back to 94.1 %. The loss is summed over the batch. A step's learning rate is the schedule's
# value / batch_size and its weight decay weight_decay x batch_size, so that the schedule is the
# rate for the mean gradient, and lr x weight decay the decay per step, whatever the batch size.
HYP = dict(
    epochs=10,               # Page: 94.1% mean with flip-TTA after 10 epochs (26 s on a V100)
    batch_size=512,          # Page; the last partial batch is dropped, leaving 97 steps per epoch
    lr_peak=1.0,             # the rate rises linearly from 0 to lr_peak in the first fifth, ...
    lr_floor=0.1,            # ... falls linearly to lr_floor and stays there for the last ...
    floor_epochs=2,          # ... floor_epochs: Page 8 ends above 0, for the EMA to average
    momentum=0.9,            # Page: Nesterov momentum
    weight_decay=5e-4,       # Page; multiplied by batch_size per step, as above
    bias_lr_scale=64.0,      # Page 8: BN biases take lr x 64 and weight decay / 64 (0 is off)
    label_smoothing=0.2,     # Page 8: targets are 0.8 x one-hot + 0.2 x uniform (0 is off)
    ema_momentum=0.99,       # Page 8: EMA of weights and BN statistics, about an epoch (0 is off)
    ema_every=5,             # ... after every 5th step of an epoch, by momentum**5 (Page 8)
    bn_split_size=32,        # Page 8: ghost batch norm over 32 images (0 uses the whole batch)
    bn_scale_frozen=True,    # Page 8: batch-norm scales are fixed at 1 (False learns them)
    celu_alpha=0.3,          # Page 8: CELU(0.3), a smooth ReLU (0 is ReLU, CELU's limit)
    logit_scale=1 / 16,      # Page: logits x 1/16, a fixed temperature of the softmax
    whitening='fixed',       # Page 8: fixed ('none' is a plain conv; 'learned' trains it)
    flip_tta=True,           # Page 8: test logits averaged with the mirror image's (False is off)
    channels=(64, 128, 256, 512),  # Page's ResNet9 widths of prep, layer1, layer2 and layer3
    whitening_images=10000,  # Page: the patches' second moment is taken over 10,000 images ...
    whitening_eps=1e-2,      # ... and each filter is divided by sqrt(eigenvalue + eps)
    pad=4,                   # Page: reflect-pad by 4, then take a random 32x32 crop
    cutout=0,                # side of a zeroed square: 0 in the 10-epoch recipe, 8 in longer ones
    augment_options=200,     # Page 8: at most 200 crop offsets (and cutout corners) per epoch
    eval_batch_size=1000,    # any size gives the same results up to rounding
    train_images=50000,      # the first N training images: all of CIFAR-10's, or fewer for a ...
    test_images=10000,       # ... learning curve or a quick check; the first N test images
)
# ==== 1. Preprocessing and augmentation on the device, one epoch's images at a time ==========
NUM_CLASSES = 10
# Page's per-channel statistics of the CIFAR-10 training set, on the 0-255 scale.
CIFAR10_MEAN = (125.31, 122.95, 113.87)
CIFAR10_STD = (62.99, 62.09, 66.70)


def upload_normalised(images, device, dtype):
    """uint8 N x 3 x 32 x 32 images, copied to the device and normalised per channel there."""
    x = torch.from_numpy(images).to(device).float()
    mean = torch.tensor(CIFAR10_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, device=device).view(1, 3, 1, 1)
    return ((x - mean) / std).to(dtype)


def balanced_choice(n, count, max_count, generator):
    """One of the numbers 0 to count - 1 for each of n positions, as Page's loader draws them: at
    most max_count distinct ones, each given to an equal share of the positions (within one)."""
    picked = torch.randperm(count, generator=generator)[:max_count]
    return picked[torch.randperm(n, generator=generator) % len(picked)]


def draw_augmentation(n, hyp, generator):
    """Every random choice of an epoch of n images, drawn on the CPU so that a seed gives the same
    run on any device. One row per kind of choice, one column per position in the epoch: the image
    there, its crop offset (top, left), whether it is flipped, and its cutout corner if any."""
    offsets = 2 * hyp['pad'] + 1  # per side: offsets 0 to 2 x pad, down and across
    offset = balanced_choice(n, offsets * offsets, hyp['augment_options'], generator)
    flip = balanced_choice(n, 2, 2, generator)  # half of the images are mirrored
    rows = [torch.randperm(n, generator=generator), offset // offsets, offset % offsets, flip]
    if hyp['cutout']:
        corners = 33 - hyp['cutout']  # per side: corners 0 to 32 - cutout, down and across
        corner = balanced_choice(n, corners * corners, hyp['augment_options'], generator)
        rows += [corner // corners, corner % corners]
    return torch.stack(rows)


def cutout(images, top, left, size):
    """Zero image i's size x size square at (top[i], left[i]), in place (0 is the mean colour)."""
    positions = torch.arange(32, device=images.device)
    rows = (positions >= top.view(-1, 1)) & (positions < top.view(-1, 1) + size)
    columns = (positions >= left.view(-1, 1)) & (positions < left.view(-1, 1) + size)
    return images.masked_fill_(rows.view(-1, 1, 32, 1) & columns.view(-1, 1, 1, 32), 0)


def augmented_epoch(padded, labels, hyp, generator, layout):
    """A fresh augmentation of every image in a fresh order, as many whole batches as fit: the
    images in the step's layout, their labels and the number of steps. Each image is the 32 x 32
    window of its padded image at its offset, read right to left where flipped, so that one gather
    makes every crop and flip in the order drawn. The draws reach the device in one copy."""
    draws = draw_augmentation(len(padded), hyp, generator)
    if padded.device.type == 'cuda':  # from pinned memory the copy is queued and the host goes on
        draws = draws.pin_memory()
    draws = draws.to(padded.device, non_blocking=True)
    steps = len(padded) // hyp['batch_size']  # the last partial batch is dropped
    order, top, left, flip, *corner = draws[:, :steps * hyp['batch_size']]
    positions = torch.arange(32, device=padded.device)
    rows = top.view(-1, 1, 1) + positions.view(1, 32, 1)
    mirrored = torch.where(flip.view(-1, 1) == 1, 31 - positions, positions)
    columns = (left.view(-1, 1) + mirrored).view(-1, 1, 32)
    images = padded[order.view(-1, 1, 1), :, rows, columns]  # N x 32 x 32 x 3
    images = images.permute(0, 3, 1, 2)  # N x 3 x 32 x 32, in channels_last memory
    if hyp['cutout']:
        cutout(images, *corner, hyp['cutout'])
    return images.contiguous(memory_format=layout), labels[order], steps


# ==== 2. The network: whitening, ghost batch norm, ResNet9, its flip-TTA forward ===============
def at_least_fp32(dtype):
    """fp32 for fp16, else dtype itself (float64 stays): where to_training_precision keeps fp32."""
    return torch.promote_types(dtype, torch.float32)


def patch_moment(images):
    """The uncentred second moment X^T X / (P - 1), as Page's cov(), of the images' P 3x3 patches
    X (27 values each, in (channel, row, col) order), summed in fp32 from shifted views."""
    x = images.float()
    n, c, h, w = x.shape
    shifted = [x[:, :, i:i + h - 2, j:j + w - 2] for i in range(3) for j in range(3)]
    patches = torch.stack(shifted, dim=2).reshape(n, c * 9, -1)  # N x 27 x windows
    return (patches @ patches.transpose(1, 2)).sum(0) / (n * patches.shape[2] - 1)


def whitening_filters(images, eps):
    """Page's first layer: 27 fixed 3x3 conv filters that whiten the images' 3x3 patches. They are
    the eigenvectors of the patches' second moment (uncentred, as Page's), each divided by
    sqrt(eigenvalue + eps), the largest first. Batch norm scales each channel but leaves nearby
    pixels and colours correlated; whitened patches are not, and the network would take epochs to
    learn to decorrelate them (Page 8: 94.1 -> 94.4 %)."""
    moment = patch_moment(images).cpu().double()  # eigenvectors in float64, on the CPU
    eigenvalues, eigenvectors = torch.linalg.eigh(moment)  # in ascending order
    eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.T.flip(0)
    filters = eigenvectors / torch.sqrt(eigenvalues + eps)[:, None]
    return filters.reshape(-1, 3, 3, 3).float().to(images.device)


class WhitenedPrep(nn.Module):
    """Page's whitening (a 3x3 conv from 3 to 27 channels) followed by the trainable 1x1 prep conv
    (27 to c_out channels), computed as the single 3x3 conv they compose to, its filters formed
    from the c_out x 27 weights at every step. It has the two convs' function and gradient, and
    never writes the 27-channel whitened image."""

    def __init__(self, whitening, c_out, learned=False):
        super().__init__()
        if learned:  # whitening='learned' trains the filters, starting from the whitening
            self.whitening = nn.Parameter(whitening)
        else:
            self.register_buffer('whitening', whitening)  # fixed, never trained
        self.weight = nn.Parameter(torch.empty(c_out, len(whitening)))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # as nn.Conv2d draws, fan-in 27

    def forward(self, x):
        wide = at_least_fp32(x.dtype)  # cheap on 3 channels; to_training_precision says why
        filters = self.weight.to(wide) @ self.whitening.to(wide).flatten(1)
        filters = filters.view(-1, *self.whitening.shape[1:])
        return F.conv2d(x.to(wide), filters, padding=1).to(x.dtype)


class GhostBatchNorm(nn.BatchNorm2d):
    """Batch norm over splits of split_size images (0 means the whole batch). Split k of s holds
    images k, k + s, k + 2s, ... Page 8: splits of about 32 images work best, because their noisier
    statistics regularise (94.1 -> 94.2 %). With the scales frozen at 1, HYP's celu_alpha and bias
    rate and decay suit them (94.2 %). It computes in fp32, its parameters' dtype.

    In NCHW memory a view makes the splits the channels of one batch_norm, as in Page's code. In
    channels_last memory no view can, so var_mean and arithmetic compute the same there, and the
    compiler fuses them with the layers around them. The running statistics move towards the mean
    of the splits' statistics."""

    def __init__(self, channels, split_size, scale_frozen=True):
        super().__init__(channels)
        self.split_size = split_size
        self.weight.requires_grad_(not scale_frozen)  # Page's scale stays 1: only the bias learns

    def forward(self, x):
        if not self.training:  # the running statistics, in fp32
            return super().forward(x.to(self.running_mean.dtype)).to(x.dtype)
        n, c, h, w = x.shape
        size = self.split_size or n
        splits = n // size
        x_wide = x.to(self.running_mean.dtype)
        if x.is_contiguous():  # NCHW
            statistics = x_wide.new_zeros(2, splits * c)  # batch_norm writes each split's here
            y = F.batch_norm(x_wide.view(-1, splits * c, h, w), statistics[0], statistics[1],
                             self.weight.repeat(splits), self.bias.repeat(splits), True, 1.0,
                             self.eps)  # momentum 1: the running statistics are the batch's
            mean, var = statistics.view(2, splits, c).mean(1)
        else:
            xs = x_wide.view(-1, splits, c, h, w)  # split k is xs[:, k]
            var, mean = torch.var_mean(xs, dim=(0, 3, 4), correction=0, keepdim=True)
            scale = torch.rsqrt(var + self.eps) * self.weight.view(1, 1, c, 1, 1)
            y = (xs - mean) * scale + self.bias.view(1, 1, c, 1, 1)
            unbiased = size * h * w / (size * h * w - 1)  # batch_norm keeps the unbiased variance
            mean, var = mean.view(splits, c).mean(0), var.view(splits, c).mean(0) * unbiased
        with torch.no_grad():
            torch._foreach_lerp_([self.running_mean, self.running_var], [mean, var], self.momentum)
        return y.view(n, c, h, w).to(x.dtype)


def conv_bn(c_in, c_out, hyp, pool=False, conv=None):
    """A 3x3 conv without bias (the batch norm's bias follows), an optional 2x2 max-pool, ghost
    batch norm and CELU; a first layer passes its own conv. Page pools before batch norm, which
    then has a quarter of the work; it cost 0.1 % of accuracy at first (Page 8). CELU is smooth
    where ReLU bends at 0, and easier to train (Page 8: 94.1 -> 94.3 %)."""
    if conv is None:
        conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
    return nn.Sequential(conv, *([nn.MaxPool2d(2)] if pool else []),
                         GhostBatchNorm(c_out, hyp['bn_split_size'], hyp['bn_scale_frozen']),
                         nn.CELU(hyp['celu_alpha']) if hyp['celu_alpha'] else nn.ReLU())


class Residual(nn.Module):
    """x + f(x), where f is two conv_bn blocks."""

    def __init__(self, channels, hyp):
        super().__init__()
        self.f = nn.Sequential(conv_bn(channels, channels, hyp), conv_bn(channels, channels, hyp))

    def forward(self, x):
        return x + self.f(x)


class ResNet9(nn.Module):
    """Page's ResNet9: whitening and prep, three pooled layers (two with residual branches), a
    global max-pool, a linear head, and logits x 1/16 (Page 8: an output scale to suit the frozen
    batch-norm scales). whitening holds the first layer's 27 filters, else zeros until weights
    are set. model.hyp holds the settings that rebuild it (load_model)."""

    def __init__(self, hyp, whitening=None):
        super().__init__()
        self.hyp = hyp
        prep, c1, c2, c3 = hyp['channels']
        prep_conv = None  # with whitening 'none', a plain 3x3 conv, as in Page's first networks
        if hyp['whitening'] != 'none':
            if whitening is None:
                whitening = torch.zeros(27, 3, 3, 3)
            prep_conv = WhitenedPrep(whitening, prep, learned=hyp['whitening'] == 'learned')
        self.prep = conv_bn(3, prep, hyp, conv=prep_conv)
        self.layer1 = nn.Sequential(conv_bn(prep, c1, hyp, pool=True), Residual(c1, hyp))
        self.layer2 = conv_bn(c1, c2, hyp, pool=True)
        self.layer3 = nn.Sequential(conv_bn(c2, c3, hyp, pool=True), Residual(c3, hyp))
        self.head = nn.Linear(c3, NUM_CLASSES, bias=False)
        self.logit_scale = hyp['logit_scale']

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.prep(x))))
        # Page's 4x4 max-pool is global here. amax would do the same, but its compiled backward
        # in half precision gave NaN.
        return self.head(F.max_pool2d(x, 4).flatten(1)) * self.logit_scale


def flip_tta_logits(model, images):
    """The logits of each image, and their mean with its mirror image's (flip test-time
    augmentation), in one forward pass. The mean is the same for an image and its mirror, which
    training's random flips can only encourage (Page 8: 94.1 -> 94.6 %, the most of all)."""
    plain, mirrored = model(torch.cat([images, images.flip(3)])).split(len(images))
    return plain, (plain + mirrored) / 2


def to_training_precision(model, dtype, device='cpu', layout=torch.contiguous_format):
    """The network in the job's dtype but for the parts that stay in fp32 (at_least_fp32). The
    precision of each part, in training and evaluation alike (dtype is fp16 on CUDA, fp32 on a CPU):
      dtype  convolutions, pooling, CELU and the head: nearly all the FLOPs, on tensor cores
      fp32   batch norm, which divides by a variance of small differences
      fp32   the whitened prep conv, whose 1x1 weights' gradient is off by up to 2 % in fp16,
             because the whitening's small-eigenvalue directions cancel most of it
      fp32   the loss (summed_loss, evaluate), a log of a sum of exponentials
      fp32   the EMA's average, whose small steps fp16 would round away
    Each weight is updated in place in its own dtype, as Page's are. The harness turns TF32 off, so
    that fp32 is fp32 on every GPU."""
    model.to(device, dtype, memory_format=layout)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.to(at_least_fp32(dtype))
        elif isinstance(module, WhitenedPrep):  # a buffer, or a parameter when learned
            module.whitening.data = module.whitening.data.to(at_least_fp32(dtype))
    return model


# ==== 3. Training: schedule, optimiser, EMA, the networks runs reuse, one epoch ================
def lr_schedule(hyp, epoch):
    """Page's piecewise-linear schedule at a fractional epoch (or an array of them). It rises from 0
    to lr_peak at epochs / 5, falls to lr_floor at epochs - floor_epochs and stays there. A run too
    short for that reaches the floor halfway from the peak to the end."""
    epochs = hyp['epochs']
    peak, floor = epochs / 5, epochs - hyp['floor_epochs']
    if floor <= peak:
        floor = (peak + epochs) / 2
    return np.interp(epoch, [0, peak, floor], [0, hyp['lr_peak'], hyp['lr_floor']])


class Nesterov:
    """Nesterov SGD with the update of Page's code, for groups with their own lr and weight decay.

    Each step's gradient (plus weight decay) is multiplied by that step's learning rate before it
    enters the momentum buffer v:  dw = -lr_t (g + wd w);  v <- m v + dw;  w <- w + dw + m v.
    torch.optim.SGD applies the current rate to the whole buffer instead, so that its steps would be
    up to 45 % larger while the rate rises. As in Page's code, dw is the gradient itself, updated
    in place."""

    def __init__(self, groups, momentum):
        self.momentum = momentum
        self.groups = [dict(group, params=list(group['params'])) for group in groups]
        for g in self.groups:
            g['velocities'] = [torch.zeros_like(p) for p in g['params']]

    @torch.no_grad()
    def step(self, lr):
        """One update at the schedule's value lr, times each group's lr_scale."""
        m = self.momentum
        for g in self.groups:
            dw = [p.grad for p in g['params']]
            torch._foreach_add_(dw, g['params'], alpha=g['weight_decay'])
            torch._foreach_mul_(dw, -lr * g['lr_scale'])
            torch._foreach_mul_(g['velocities'], m)
            torch._foreach_add_(g['velocities'], dw)
            torch._foreach_add_(dw, g['velocities'], alpha=m)
            torch._foreach_add_(g['params'], dw)


def optimiser(model, hyp):
    """Page's two groups: the batch-norm biases, with bias_lr_scale, and every other trainable
    weight. Another optimiser may take its place if step(lr) makes one step after a backward."""
    norm_biases = {id(m.bias) for m in model.modules() if isinstance(m, nn.BatchNorm2d)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    biases = [p for p in trainable if id(p) in norm_biases]
    weights = [p for p in trainable if id(p) not in norm_biases]
    batch, decay = hyp['batch_size'], hyp['weight_decay']
    bias_scale = hyp['bias_lr_scale'] or 1  # 0 is off: the weights' rate and decay
    return Nesterov([dict(params=weights, lr_scale=1 / batch, weight_decay=decay * batch),
                     dict(params=biases, lr_scale=bias_scale / batch,
                          weight_decay=decay * batch / bias_scale)], hyp['momentum'])


def averaged_tensors(model):
    """What the EMA (exponential moving average) averages: every floating-point weight and batch
    norm statistic. Page 8: a high rate travels far but ends noisy. An average of the last 100 or
    so steps sits nearer the minimum than any one of them, so the rate need not fall to 0
    (94.1 -> 94.3 %)."""
    return [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]


@torch.no_grad()
def ema_update(averages, tensors, momentum):
    """averages <- momentum x averages + (1 - momentum) x tensors, in the averages' fp32."""
    torch._foreach_lerp_(averages, [t.to(a.dtype) for a, t in zip(averages, tensors)], 1 - momentum)


def summed_loss(model, images, labels, label_smoothing):
    """The label-smoothed cross-entropy summed over the batch, in fp32, and the logits. Page 8:
    partly uniform targets keep the outputs from growing over-confident (94.1 -> 94.2 %)."""
    logits = model(images)
    loss = F.cross_entropy(logits.to(at_least_fp32(logits.dtype)), labels,
                           label_smoothing=label_smoothing, reduction='sum')
    return loss, logits


class Trainer:
    """What the runs of one graph setting (the harness's GRAPH_SETTINGS) reuse: the network, its
    EMA in fp32, eval_network (the EMA in the network's dtype), the loss and flip-TTA functions,
    compiled in torch.compile's compile_mode unless it is False, and the layout: channels_last
    where compiled, but on MPS. new_run() starts each run."""

    def __init__(self, hyp, device, dtype, compile_mode):
        self.device, self.dtype = device, dtype
        channels_last = compile_mode and device.type != 'mps'
        layout = torch.channels_last if channels_last else torch.contiguous_format
        self.memory_format = layout

        def build(dtype):  # its weights are left unset: new_run() draws them
            with torch.device('meta'):
                model = ResNet9(hyp)
            return to_training_precision(model.to_empty(device=device), dtype, device, layout)
        self.network = build(dtype)
        self.eval_network = build(dtype).eval().requires_grad_(False)
        self.ema = build(at_least_fp32(dtype)).eval().requires_grad_(False)
        self.ema_tensors = averaged_tensors(self.ema)  # made once, so an update is one call
        self.trained_tensors = averaged_tensors(self.network)
        self.eval_tensors = averaged_tensors(self.eval_network)
        self.loss, self.tta_logits = summed_loss, flip_tta_logits
        if compile_mode:
            self.loss = torch.compile(summed_loss, dynamic=False, mode=compile_mode)
            self.tta_logits = torch.compile(flip_tta_logits, dynamic=False, mode=compile_mode)

    @torch.no_grad()
    def new_run(self, hyp, seed, whitening=None):
        """Start a run: new weights, and an optimiser with the run's settings. The weights are drawn
        on the CPU from a generator seeded with seed, so that a seed gives the same weights on any
        device and the caller's random state is untouched. Each convolution and the head are drawn
        as torch draws them, in the order a ResNet9 builds them: the weights equal those of a
        ResNet9 built after torch.manual_seed(seed). whitening holds the first layer's filters."""
        generator = torch.Generator().manual_seed(seed)
        for module in self.ema.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()  # a scale of 1, a bias of 0, statistics of 0 and 1
            elif isinstance(module, (nn.Conv2d, nn.Linear, WhitenedPrep)):
                weight = torch.empty(module.weight.shape)
                nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
                module.weight.copy_(weight)
            elif next(module.parameters(recurse=False), None) is not None:
                raise TypeError(f'new_run() draws no weights for a {type(module).__name__}: add '
                                'them there')
            if isinstance(module, WhitenedPrep):
                module.whitening.copy_(whitening)
        self.network.load_state_dict(self.ema.state_dict())  # in the network's dtype and layout
        self.optimiser = optimiser(self.network, hyp)


def train_epoch(trainer, images, labels, rates, hyp):
    """One pass over the epoch's batches, one step per learning rate in rates. Returns the summed
    loss and the count of correct answers, as device tensors that nothing waits for. The EMA is
    updated after batches 0, 5, 10, ... (without an EMA, it copies the weights after the last)."""
    steps, batch = len(rates), hyp['batch_size']
    ema_steps = range(0, steps, hyp['ema_every']) if hyp['ema_momentum'] else [steps - 1]
    momentum_per_update = hyp['ema_momentum'] ** hyp['ema_every']
    loss_sum = correct = 0  # device tensors after the first step
    for i, lr in enumerate(rates):
        x, y = images[i * batch:(i + 1) * batch], labels[i * batch:(i + 1) * batch]
        trainer.network.zero_grad()  # None frees the last step's gradients before the forward
        loss, logits = trainer.loss(trainer.network, x, y, hyp['label_smoothing'])
        loss.backward()
        trainer.optimiser.step(lr)
        if i in ema_steps:
            ema_update(trainer.ema_tensors, trainer.trained_tensors, momentum_per_update)
        loss_sum += loss.detach()
        correct += (logits.argmax(1) == y).sum()
    return loss_sum, correct


# ==== 4. Evaluation: the EMA model with flip test-time augmentation ============================
def upload_test_set(data, trainer):
    """The test images on the device, in the network's dtype and layout, and their labels."""
    images = upload_normalised(data['test_images'], trainer.device, trainer.dtype)
    images = images.contiguous(memory_format=trainer.memory_format)
    labels = torch.from_numpy(data['test_labels']).to(trainer.device, torch.int64)
    return images, labels


@torch.no_grad()
def evaluate(trainer, images, labels, hyp):
    """The EMA's weights, cast to the network's dtype, on the test set: the summed loss (label
    smoothed) and the count of correct answers, with flip-TTA if hyp says so, and the count of
    correct answers of the first view alone."""
    torch._foreach_copy_(trainer.eval_tensors, trainer.ema_tensors)
    loss_sum = correct = plain_correct = 0  # device tensors after the first batch
    for x, y in zip(images.split(hyp['eval_batch_size']), labels.split(hyp['eval_batch_size'])):
        plain, tta = trainer.tta_logits(trainer.eval_network, x)
        logits = tta if hyp['flip_tta'] else plain
        loss_sum += F.cross_entropy(logits.to(at_least_fp32(logits.dtype)), y, reduction='sum',
                                    label_smoothing=hyp['label_smoothing'])
        correct += (logits.argmax(1) == y).sum()
        plain_correct += (plain.argmax(1) == y).sum()
    return loss_sum, correct, plain_correct


# ==== 5. One run, timed by the DAWNBench rule ==================================================
def synced_clock(device):
    """The time once the device has done the work queued, since CUDA and MPS run behind the host."""
    if device.type != 'cpu':
        torch.accelerator.synchronize(device)
    return time.perf_counter()


def diverged(rows):
    """Whether the last epoch's training or test loss is NaN or infinite: the run has failed."""
    return not (math.isfinite(rows[-1]['train_loss']) and math.isfinite(rows[-1]['valid_loss']))


def train_run(data, test_set, trainer, hyp, seed, on_epoch, steps_per_epoch=None):
    """Train one model on data's uint8 training arrays and return one row per epoch. The model's
    EMA is left in trainer.ema. test_set is upload_test_set's. seed fixes the weights and every
    augmentation draw, which are made on the CPU, so that a run is the same on any device.
    steps_per_epoch cuts the epochs short for a warm-up. The clock leaves out the evaluation."""
    device, layout = trainer.device, trainer.memory_format
    generator = torch.Generator().manual_seed(seed)
    start = synced_clock(device)
    images = upload_normalised(data['train_images'], device, trainer.dtype)
    labels = torch.from_numpy(data['train_labels']).to(device, torch.int64)
    padded = F.pad(images, (hyp['pad'],) * 4, mode='reflect')
    whitening = None
    if hyp['whitening'] != 'none':
        whitening = whitening_filters(images[:hyp['whitening_images']], hyp['whitening_eps'])
    del images  # the steps read the padded copy
    trainer.new_run(hyp, seed, whitening)
    epoch_images, epoch_labels, steps = augmented_epoch(padded, labels, hyp, generator, layout)
    steps = min(steps, steps_per_epoch or steps)
    # The schedule's rate at the end of each step, so that the first step's is not 0.
    rates = lr_schedule(hyp, np.arange(1, hyp['epochs'] * steps + 1) / steps).tolist()
    total_time, rows = synced_clock(device) - start, []
    for epoch in range(1, hyp['epochs'] + 1):
        start = time.perf_counter()  # the device is idle, since the last epoch's sums were read
        epoch_rates = rates[(epoch - 1) * steps:epoch * steps]
        train_loss, train_correct = train_epoch(trainer, epoch_images, epoch_labels, epoch_rates,
                                                hyp)
        if epoch < hyp['epochs']:  # the next epoch's images, queued behind this epoch's steps
            epoch_images, epoch_labels, _ = augmented_epoch(padded, labels, hyp, generator, layout)
        train_time = synced_clock(device) - start
        start = time.perf_counter()
        valid_loss, valid_correct, plain_correct = evaluate(trainer, *test_set, hyp)
        valid_time = synced_clock(device) - start
        total_time += train_time
        sums = torch.stack([train_loss, train_correct, valid_loss, valid_correct, plain_correct])
        train_loss, train_correct, valid_loss, valid_correct, plain_correct = sums.tolist()
        n_train, n_test = steps * hyp['batch_size'], len(data['test_images'])
        rows.append(dict(epoch=epoch, lr=epoch_rates[-1], train_time=train_time,
                         train_loss=train_loss / n_train, train_acc=train_correct / n_train,
                         valid_time=valid_time, valid_loss=valid_loss / n_test,
                         valid_acc=valid_correct / n_test, total_time=total_time,
                         plain_acc=plain_correct / n_test))
        on_epoch(rows[-1])
        if diverged(rows):
            break  # the caller reports the run as failed
    return rows


# #############################################################################################
# Harness: what a run is given (device, dtype, compilation, TF32 off, --tiny's TINY), and all that
# is around it: the download, the Python entry, reporting, statistics, job files and the command
# line. What it gives every run alike is all it does to a run's numbers.
# #############################################################################################

import argparse, ast, bisect, codecs, contextlib, datetime, difflib, hashlib, http.client
import importlib.util, io, json, os, pickle, platform, shutil, signal, sys, tarfile, tempfile
import textwrap, urllib.request
from pathlib import Path

# --tiny runs the recipe narrow, on a subset, in seconds on 2 CPU cores. Its EMA momentum is 0.9,
# because 0.99 would average over the last 100 or so steps, too many of its 184.
TINY = dict(epochs=4, batch_size=64, train_images=3000, test_images=500, channels=(8, 16, 32, 64),
            ema_momentum=0.9, whitening_images=3000, eval_batch_size=250)


def print_nothing(*args, **kwargs):
    """Stands in for print where train() prints nothing: the warm-up's line and the rows."""


class UserError(ValueError):
    """A problem the user can fix: main prints the message on one line and exits non-zero."""


# ==== Download and safe loading of CIFAR-10's files ============================================
CLASSES = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')
CIFAR10_URL = 'https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz'
CIFAR10_MD5 = 'c58f30108f718f92721af3b95e74349a'
BATCHES_DIR = 'cifar-10-batches-py'
OFFICIAL_MD5 = dict(zip(  # the five batch files of training images, then the test images
    ['data_batch_1', 'data_batch_2', 'data_batch_3', 'data_batch_4', 'data_batch_5', 'test_batch'],
    ['c99cafc152244af753f735de768cd75f', 'd4bba439e000b95fd0a9bffe97cbabec',
     '54ebc095f3ab1f0389bbae665268c751', '634d18415352ddfa80567beed471001a',
     '482c414d41f54cd18b22e5b47d7c54d7', '40351d587109b95175f43aff81a1287e']))


def ensure_cifar10(data_dir, url=None, md5=CIFAR10_MD5):
    """The folder of the batch files, downloaded if missing, through a part file and a staging
    folder (from url, $CIFAR10_URL or the official address)."""
    data_dir, url = Path(data_dir), url or os.environ.get('CIFAR10_URL') or CIFAR10_URL
    if (data_dir / 'data_batch_1').is_file():
        return data_dir
    archive = data_dir / CIFAR10_URL.rsplit('/', 1)[-1]  # the official name, from any mirror
    partial = archive.with_name(f'.{archive.name}.part')
    try:
        if not (data_dir / BATCHES_DIR).is_dir():
            data_dir.mkdir(parents=True, exist_ok=True)
            if not archive.exists():  # one already there is not md5-checked: damage fails below
                print(f'downloading {url}', file=sys.stderr)
                with urllib.request.urlopen(url, timeout=60) as response, open(partial, 'wb') as f:
                    shutil.copyfileobj(response, f, 1 << 20)
                got = hashlib.md5(partial.read_bytes()).hexdigest()
                if got != md5:
                    raise ValueError(f'its md5 is {got}, not {md5}, so it is cut short or not the '
                                     'CIFAR-10 archive')
                os.replace(partial, archive)
            with tempfile.TemporaryDirectory(dir=data_dir, prefix='.extract-') as staging:
                with tarfile.open(archive, 'r:gz') as tar:
                    tar.extractall(staging, filter='data')  # refuses absolute paths and links out
                os.replace(os.path.join(staging, BATCHES_DIR), data_dir / BATCHES_DIR)
    except (OSError, ValueError, EOFError, tarfile.TarError, http.client.HTTPException) as e:
        why = getattr(e, 'reason', e)  # the reason of a URLError or an HTTPError
        raise UserError(f'no CIFAR-10 in --data-dir {data_dir} (is that path right?), nor from '
                        f'{url} ({why}): put {BATCHES_DIR}/ there yourself, or delete a damaged '
                        f'{archive.name} there') from None
    finally:
        with contextlib.suppress(OSError):  # NotADirectoryError where a file is in the path
            partial.unlink(missing_ok=True)
    return data_dir / BATCHES_DIR


class BatchUnpickler(pickle.Unpickler):
    """Reads a CIFAR-10 batch file, a pickle of numpy arrays. It is given only the names that such
    arrays need, so that a file made to run code when it is loaded runs none."""
    reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]  # numpy's own, whatever its module's name
    NAMES = {('numpy.core.multiarray', '_reconstruct'): reconstruct,  # numpy 1's module name
             ('numpy._core.multiarray', '_reconstruct'): reconstruct,  # numpy 2's
             ('numpy', 'ndarray'): np.ndarray, ('numpy', 'dtype'): np.dtype,
             ('_codecs', 'encode'): codecs.encode}  # how Python 3 pickles an array's bytes

    def find_class(self, module, name):
        if (module, name) not in self.NAMES:
            raise pickle.UnpicklingError(f'it asks for {module}.{name}, which no batch file needs')
        return self.NAMES[module, name]


def images_problem(images, labels=None):
    """Why images are not uint8 N x 3 x 32 x 32, N > 0, or labels not an integer 0-9 per image."""
    images = np.asarray(images)
    if not (images.dtype == np.uint8 and images.shape[1:] == (3, 32, 32) and len(images)):
        return f'not uint8 N x 3 x 32 x 32 images but {images.dtype} {images.shape}'
    if labels is None:
        return None
    labels = np.asarray(labels)
    if labels.shape != (len(images),) or labels.dtype.kind not in 'iu':
        return f'not {len(images)} integer labels but {labels.dtype} {labels.shape}'
    if labels.min() < 0 or labels.max() >= NUM_CLASSES:
        return f'labels from {labels.min()} to {labels.max()}, not within 0-{NUM_CLASSES - 1}'
    return None


def load_cifar10(folder):
    """The training and test sets, uint8 images and int64 labels, their provenance and digest."""
    images, labels, md5s = [], [], []
    for name in OFFICIAL_MD5:
        path = Path(folder) / name
        try:
            raw = path.read_bytes()
            batch = BatchUnpickler(io.BytesIO(raw), encoding='latin1').load()
            pixels, classes = batch['data'], np.asarray(batch['labels'])
            pixels = pixels.reshape(len(pixels), 3, 32, 32)  # 3 x 32 x 32 values per row, or raises
            why = images_problem(pixels, classes)
            if why:
                raise ValueError(why)
        except Exception as e:  # a missing file, and the ways in which a damaged pickle fails
            why = e.strerror if isinstance(e, OSError) else f'{type(e).__name__}: {e}'
            raise UserError(f'{path}: not a CIFAR-10 python batch ({why}): {folder} must hold a '
                            'whole copy (a --data-dir without one gets a download)') from None
        images.append(pixels)
        labels.append(classes.astype(np.int64))
        md5s.append(hashlib.md5(raw).hexdigest())
    differing = [name for name, md5 in zip(OFFICIAL_MD5, md5s) if md5 != OFFICIAL_MD5[name]]
    provenance = 'official CIFAR-10 (all six batch files match their published md5s)'
    if differing:
        provenance = (f'NOT the official CIFAR-10: {", ".join(differing)} differ from the official '
                      'md5s, so accuracies below are not CIFAR-10 results')
    return dict(train_images=np.concatenate(images[:5]), train_labels=np.concatenate(labels[:5]),
                test_images=images[5], test_labels=labels[5], provenance=provenance,
                digest=hashlib.sha256(' '.join(md5s).encode()).hexdigest()[:16])


def first_images(data, hyp):
    """data's first hyp['train_images'] and hyp['test_images'], with their labels, as arrays."""
    data = {f'{kind}_{part}': np.asarray(data[f'{kind}_{part}'])[:hyp[f'{kind}_images']]
            for kind in ('train', 'test') for part in ('images', 'labels')}
    if len(data['train_images']) < hyp['batch_size']:
        raise UserError(f"batch_size={hyp['batch_size']}: more than the "
                        f"{len(data['train_images'])} training images")
    return data


# ==== Devices, precision and compilation =======================================================
def pick_device(name):
    """The device named, or for auto the best there is."""
    if name == 'auto':
        accelerator = torch.accelerator.current_accelerator(check_available=True)  # None on a CPU
        name = 'cpu' if accelerator is None else accelerator.type
    try:
        device = torch.device(name)
        torch.empty(1, device=device)  # raises where torch cannot compute on it
    except (RuntimeError, AssertionError) as e:  # AssertionError: a torch built without CUDA
        why = str(e).strip().split('\n')[0]
        raise UserError(f'--device {name}: torch cannot train on it here ({why}); choose auto, '
                        'cuda, cuda:N, mps or cpu') from None
    return device


def pick_dtype(name, device):
    """The dtype named, else fp16 on CUDA and fp32 elsewhere (a CPU emulates fp16, slowly)."""
    if name == 'auto':
        name = 'fp16' if device.type == 'cuda' else 'fp32'
    return dict(fp16=torch.float16, fp32=torch.float32)[name]


def pick_compile_mode(option, device, tiny=False):
    """torch.compile's mode, or False for eager: by default compiled, but not on MPS (experimental
    there) nor for --tiny (compiling would outlast it). CUDA replays the steps as CUDA graphs."""
    if option is None:
        option = device.type != 'mps' and not tiny
    if not option:
        return False
    return 'reduce-overhead' if device.type == 'cuda' else 'default'


@contextlib.contextmanager
def torch_settings(device, compile_mode=False):
    """torch as runs need it, and as it was afterwards: cuDNN's search on CUDA (a run's shapes are
    fixed), no TF32 (fp32 is fp32 on any GPU), and room for a graph per GRAPH_SETTINGS of a sweep
    (256 per function, where torch keeps 8 and then runs eager)."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32
    cudnn.benchmark = device.type == 'cuda'
    cudnn.allow_tf32 = matmul.allow_tf32 = False
    graphs = contextlib.nullcontext()
    if compile_mode:  # only then, since importing the compiler takes a second or more
        graphs = torch._dynamo.config.patch(recompile_limit=256)
    try:
        with graphs:
            yield
    finally:
        cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = saved


def warmed_up_trainer(data, hyp, device, dtype, compile_mode, log):
    """A new Trainer, compiled if asked, with its compiled step checked against eager's. An untimed
    run of 2 steps then pays the one-off costs, twice on a GPU (cuDNN's search, CUDA graphs). Since
    inductor skips CUDA graphs unasked where they cannot hold a pass, the log gives its count."""
    trainer = Trainer(hyp, device, dtype, compile_mode)
    if compile_mode:
        skips_before = torch._dynamo.utils.counters['inductor']['cudagraph_skips']
        start = time.perf_counter()
        x = upload_normalised(data['train_images'][:hyp['batch_size']], device, dtype)
        y = torch.from_numpy(data['train_labels'][:hyp['batch_size']]).to(device, torch.int64)
        try:
            trainer.new_run(hyp, 0, whitening_filters(x, hyp['whitening_eps']))
            x = x.contiguous(memory_format=trainer.memory_format)
            why = compiled_step_error(trainer, x, y, hyp)
        except Exception as error:  # no C++ compiler, a damaged cache file, ...
            cause = error  # the root of what the compiler wrapped
            while getattr(cause, 'inner_exception', None) or cause.__cause__:
                cause = getattr(cause, 'inner_exception', None) or cause.__cause__
            reason = f'{type(cause).__name__}: {str(cause).strip()}'.split('\n')[0][:200]
            why = f'failed ({reason})'
        if why:
            raise UserError(f'torch.compile {why}; --no-compile trains eager')
        log(f'torch.compile ({compile_mode}): {time.perf_counter() - start:.1f} s, its step '
            "checked against eager's, outside every run's time", flush=True)
    test_set = upload_test_set(data, trainer)
    for _ in range(1 if device.type == 'cpu' else 2):
        train_run(data, test_set, trainer, {**hyp, 'epochs': 1}, 0, print_nothing,
                  steps_per_epoch=2)
    if compile_mode == 'reduce-overhead':
        skips = torch._dynamo.utils.counters['inductor']['cudagraph_skips'] - skips_before
        log(f"CUDA graphs: inductor's count of skips in the warm-up is {skips} "
            '(TORCH_LOGS=cudagraphs names each)', flush=True)
    return trainer


def compiled_step_error(trainer, x, y, hyp):
    """How the compiled step's loss and gradients differ from eager's beyond rounding, or None.
    Eager's own difference from the same step in a wider dtype (on the CPU for MPS) is its rounding;
    each may differ by 4 times that, and by 4 times the median of those at least."""
    def loss_and_gradients(model, loss_function, images):
        model.zero_grad()  # every .grad to None
        loss = loss_function(model, images, y.to(images.device), hyp['label_smoothing'])[0]
        loss.backward()
        gradients = [p.grad for p in model.parameters() if p.requires_grad]
        return [t.detach().cpu().double() for t in [loss, *gradients]]
    wide = torch.float64 if trainer.dtype == torch.float32 else torch.float32
    on = 'cpu' if x.device.type == 'mps' else x.device
    reference = loss_and_gradients(copy.deepcopy(trainer.network).to(on, wide), summed_loss,
                                   x.to(on, wide))
    eager = loss_and_gradients(trainer.network, summed_loss, x)
    compiled = loss_and_gradients(trainer.network, trainer.loss, x)
    if not all(torch.isfinite(t).all() for t in eager + reference):
        return None  # nothing to judge by: eager training will meet the same NaN and say so
    names = ['the loss'] + [f"{name}'s gradient" for name, p in trainer.network.named_parameters()
                            if p.requires_grad]
    sizes = [float(t.norm()) or 1.0 for t in reference]
    rounding = [float((e - r).norm()) / size for e, r, size in zip(eager, reference, sizes)]
    floor = float(np.median(rounding))
    for name, got, expected, size, error in zip(names, compiled, eager, sizes, rounding):
        gap = float((got - expected).norm()) / size
        bound = 4 * max(error, floor)
        if not gap <= bound:  # NaN too
            return (f"computes a wrong step ({name} differs from eager's by {gap:.2g} of its size, "
                    f'beyond the {bound:.2g} its rounding allows)')
    return None


# The settings that shape the networks or enter a compiled graph as constants. Each combination,
# with the device, dtype and compile mode, has a Trainer of its own; the rest reach each run.
GRAPH_SETTINGS = ('batch_size', 'bn_split_size', 'bn_scale_frozen', 'celu_alpha', 'channels',
                  'whitening', 'logit_scale', 'label_smoothing', 'eval_batch_size')
TRAINERS = {}  # the last 4 Trainers used, by their settings, for sweeps that go back and forth


def trainer_for(data, hyp, device, dtype, compile_mode, log):
    """The Trainer of hyp's graph settings, which warmed_up_trainer makes when they are new."""
    key = (json.dumps([hyp[name] for name in GRAPH_SETTINGS]), str(device), dtype, compile_mode)
    if key not in TRAINERS:
        TRAINERS[key] = warmed_up_trainer(data, hyp, device, dtype, compile_mode, log)
    TRAINERS[key] = TRAINERS.pop(key)  # now the last used
    if len(TRAINERS) > 4:
        del TRAINERS[next(iter(TRAINERS))]
    return TRAINERS[key]


# ==== From Python: a run on the data a caller gives, a model's test logits, saving and loading =
def hyperparameters(settings=None, tiny=False):
    """HYP, with TINY's values over it if tiny, and settings over both."""
    return {**HYP, **(TINY if tiny else {}), **(settings or {})}


def train(data, hyp=None, seed=0, tiny=False, device='auto', dtype='auto', compile=None,
          progress=False):
    """One run of the recipe, as the command line trains it, on data: uint8 N x 3 x 32 x 32
    'train_images' and 'test_images' with integer 'train_labels' and 'test_labels' 0-9, as
    load_cifar10 returns them, or a subset or relabelling. The run takes the first
    hyp['train_images'] and hyp['test_images'] of them; hyp goes over HYP (over TINY's if tiny).
    Returns the model (see trained_model) and the rows. Calls with the same GRAPH_SETTINGS reuse
    the first's networks. A bad input raises a UserError (a ValueError) naming it."""
    hyp = hyperparameters(hyp, tiny)
    why = hyp_problem(hyp)
    if why:
        raise UserError(f'hyp: {why}')
    for kind in ('train', 'test'):
        if f'{kind}_images' not in data or f'{kind}_labels' not in data:
            raise UserError(f"data has no '{kind}_images' or no '{kind}_labels'")
        why = images_problem(data[f'{kind}_images'], data[f'{kind}_labels'])
        if why:
            raise UserError(f"data['{kind}_images'], data['{kind}_labels']: {why}")
    data = first_images(data, hyp)
    device = pick_device(device)
    dtype = pick_dtype(dtype, device)
    compile_mode = pick_compile_mode(compile, device, tiny)
    with torch_settings(device, compile_mode):
        trainer = trainer_for(data, hyp, device, dtype, compile_mode, print_nothing)
        rows = train_run(data, upload_test_set(data, trainer), trainer, hyp, seed, print_nothing)
    if progress:
        print(f"seed {seed}: valid accuracy {100 * rows[-1]['valid_acc']:.2f} % after "
              f"{len(rows)} epochs, {rows[-1]['total_time']:.1f} s", flush=True)
    return trained_model(trainer, hyp, data), rows


def trained_model(trainer, hyp, data):
    """A copy of the run's EMA model: fp32, eval mode, on the device, no gradients. Its hyp is the
    run's, with the numbers of images that trained and scored it."""
    model = copy.deepcopy(trainer.ema)
    model.hyp = {**hyp, 'train_images': len(data['train_images']),
                 'test_images': len(data['test_images'])}
    return model


@torch.no_grad()
def test_logits(model, images, batch_size=1000):
    """A model's flip-TTA logits for uint8 N x 3 x 32 x 32 images, in their order, on the CPU, in
    the model's dtype (fp32 for train()'s). The model's mode is left as it was."""
    why = images_problem(images)
    if why:
        raise UserError(f'images: {why}')
    weight = next(model.parameters())
    training = model.training
    try:
        with torch_settings(weight.device):
            x = upload_normalised(np.asarray(images), weight.device, weight.dtype)
            logits = [flip_tta_logits(model.eval(), batch)[1] for batch in x.split(batch_size)]
    finally:
        model.train(training)
    return torch.cat(logits).cpu()


def save_model(model, path, **extra):
    """Write model for load_model: its weights and hyp, which rebuilds it, and extra's fields."""
    state = {name: tensor.cpu() for name, tensor in model.state_dict().items()}
    checkpoint = dict(state_dict=state, hyperparameters=model.hyp, classes=CLASSES,
                      mean=CIFAR10_MEAN, std=CIFAR10_STD, **extra)
    memory = io.BytesIO()
    torch.save(checkpoint, memory)  # then written whole, or not at all
    write_atomically(path, memory.getvalue())


def load_model(path):
    """The model save_model or --save wrote: fp32, eval mode, on the CPU. torch.load reads only
    tensors and plain values (weights_only), so that the file runs no code."""
    checkpoint = torch.load(path, map_location='cpu', weights_only=True)
    model = ResNet9(checkpoint['hyperparameters'])
    model.load_state_dict(checkpoint['state_dict'])
    return model.eval().requires_grad_(False)


# ==== Reporting: the Myrtle.ai / DAWNBench table, the header, the summary over runs ============
COLUMNS = ('epoch', 'lr', 'train time', 'train loss', 'train acc',
           'valid time', 'valid loss', 'valid acc', 'total time')
ROW_KEYS = [column.replace(' ', '_') for column in COLUMNS]  # a row also holds plain_acc


def table_line(values):
    """One line of 12-character right-aligned columns, with 4 decimals for floats."""
    return ''.join(f'{v:>12.4f}' if isinstance(v, float) else f'{v:>12}' for v in values)


def table_printer(run, runs, seed):
    """Print a run's title and the columns, and return the function that prints a row (train_run's
    on_epoch), with FAILED below a row whose loss is not finite."""
    print(f'\nrun {run}/{runs} (seed {seed})\n{table_line(COLUMNS)}', flush=True)

    def print_row(row):
        print(table_line(row[key] for key in ROW_KEYS), flush=True)
        if diverged([row]):
            print(f"run {run} FAILED: the loss was not finite in epoch {row['epoch']}")
    return print_row


def evaluation_label(hyp):
    """What valid accuracy measures, as the output names it: 'flip-TTA, EMA' for the recipe."""
    return (f"{'flip-TTA' if hyp['flip_tta'] else 'no TTA'}, "
            f"{'EMA' if hyp['ema_momentum'] else 'no EMA: the trained weights'}")


def header_lines(job):
    """A log's lines before its first row, from a job's identity."""
    hyp = job['hyperparameters']
    settings = ', '.join(f'{k}={v}' for k, v in hyp.items())
    return [f"train_cifar10.py {job['script_sha256']} | torch {job['torch']} | {job['device']}",
            f"dtype {job['dtype'].split('.')[-1]} (batch norm and the loss fp32; no TF32), in "
            f"training and evaluation | seed {job['seed']} | {job['train_images']} train / "
            f"{job['test_images']} test images",
            *textwrap.wrap(f'hyperparameters: {settings}', 100, subsequent_indent='    ',
                           break_long_words=False),
            f"data: {job['data']} (files' digest {job['data_digest']})",
            f'valid = accuracy ({evaluation_label(hyp)}) and label-smoothed loss; total time = '
            'preprocessing + training (DAWNBench rule: validation excluded, after a warm-up)']


def summarize(runs, hyp=HYP):
    """Statistics of the finished runs; failed runs are counted but not averaged."""
    finished = [r for r in runs if not r['failed']]
    summary = dict(runs=len(runs), finished=len(finished), failed=len(runs) - len(finished))
    if not finished:
        return summary
    acc, times = (np.array([r[key] for r in finished]) for key in ('accuracy', 'time_s'))
    summary.update(acc_mean=acc.mean(), acc_min=acc.min(), acc_median=float(np.median(acc)),
                   acc_max=acc.max(), time_mean_s=times.mean(), evaluated=evaluation_label(hyp),
                   time_median_s=float(np.median(times)), time_max_s=times.max())
    by_epoch = [[row['valid_acc'] for row in run['rows']] for run in finished]
    summary['acc_by_epoch'] = np.mean(by_epoch, axis=0).tolist()
    if hyp['flip_tta']:  # TTA's first view alone
        summary['acc_no_tta_mean'] = float(np.mean([r['rows'][-1]['plain_acc'] for r in finished]))
    if len(acc) > 1:
        summary['acc_std'] = acc.std(ddof=1)
        half_width = t_quantile(0.975, len(acc) - 1) * summary['acc_std'] / math.sqrt(len(acc))
        low, high = acc.mean() - half_width, acc.mean() + half_width
        summary['acc_ci95'] = (max(low, 0.0), min(high, 1.0))  # an accuracy lies in 0-1
        summary['acc_ci95_clipped'] = not 0 <= low <= high <= 1
    return summary  # numpy's float64 is a Python float, which json writes


def summary_lines(summary):
    """The log's last lines: the runs, their accuracy and time, and the job's pace."""
    def percent(*keys):
        return ' / '.join(f'{100 * summary[key]:.2f}' for key in keys)
    finished = summary['finished']
    failed = f", {summary['failed']} failed (the loss not finite)" if summary['failed'] else ''
    lines = [f'runs: {finished} finished{failed}']
    if not finished:
        return lines + ['no run finished: no statistics']
    spread = 'one run: no standard deviation'
    if finished > 1:
        spread = f"standard deviation {percent('acc_std')} %"
    lines.append(f"accuracy ({summary['evaluated']}): mean {percent('acc_mean')} %, {spread}")
    if finished > 1:
        low, high = (100 * x for x in summary['acc_ci95'])
        clipped = ' (clipped to 0-100 %: too few runs)' if summary['acc_ci95_clipped'] else ''
        lines.append(f'95% confidence interval of the mean: [{low:.2f}, {high:.2f}] %{clipped}')
    lines.append(f"min / median / max: {percent('acc_min', 'acc_median', 'acc_max')} %")
    if 'acc_no_tta_mean' in summary:  # what flip-TTA adds
        lines.append(f"without flip-TTA (each image alone): mean {percent('acc_no_tta_mean')} %")
    by_epoch = ' '.join(f'{100 * acc:.2f}' for acc in summary['acc_by_epoch'])
    lines += textwrap.wrap(f'mean by epoch: {by_epoch} %', 100)  # the course of training
    lines.append('time per run: mean {time_mean_s:.2f} s, median {time_median_s:.2f} s, max '
                 '{time_max_s:.2f} s'.format(**summary))
    if 'trained' in summary:
        ran = summary['trained']
        lines.append(f"job: {ran} run{'s' * (ran != 1)} in {summary['wall_s']:.1f} s of wall time "
                     f"after the warm-up, {3600 * ran / summary['wall_s']:.0f} runs per hour")
    return lines


def plot_jobs(path, jobs, names=('',)):
    """Draw --plot: each job's valid accuracy by epoch, its runs' mean and a band of all of them."""
    if not any(not run['failed'] for job in jobs for run in job['runs']):
        print(f'--plot {path}: no finished run to draw, nothing written')
        return None
    from matplotlib.figure import Figure  # imported here, since only --plot needs matplotlib
    from matplotlib.ticker import MaxNLocator
    figure = Figure((8, 4 + len(jobs) / 4), layout='constrained')
    curves = figure.subplots()
    for name, job in zip(names, jobs):
        runs = [run for run in job['runs'] if not run['failed']]
        valid = 100 * np.array([[row['valid_acc'] for row in run['rows']] for run in runs])
        epochs = np.arange(1, valid.shape[1] + 1)
        given = ['--tiny'] * job['options']['tiny'] + job['options']['set']
        label = f"{name}{len(runs)} run(s): {' '.join(given) or 'the recipe'}"
        line, = curves.plot(epochs, valid.mean(0), '.-', label=label)
        curves.fill_between(epochs, valid.min(0), valid.max(0), color=line.get_color(), alpha=0.2)
    curves.set(xlabel='epoch', ylabel='valid accuracy, % (mean; band: every run)', xlim=(0, None))
    curves.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs
    figure.legend(loc='outside lower center')
    devices = {f"{job['device']}, {job['dtype'].split('.')[-1]}": None for job in jobs}
    figure.suptitle(' | '.join(devices))
    picture = io.BytesIO()
    figure.savefig(picture, format=Path(path).suffix[1:], dpi=150)
    write_atomically(path, picture.getvalue())
    return figure


def device_description(device):
    """The device as the header and a job's identity name it, with a CPU's kernels and threads."""
    if device.type == 'cuda':
        return (f'{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, cuDNN '
                f'{torch.backends.cudnn.version()}')
    if device.type == 'mps':
        return 'Apple MPS'
    kernels = torch.backends.cpu.get_cpu_capability()  # they round differently, so runs differ
    threads = torch.get_num_threads()
    return f"CPU ({platform.machine()}, {kernels} kernels, {threads} thread{'s' * (threads != 1)})"


# ==== Statistics: the t distribution, Welch's comparison, what a comparison can resolve ========
def t_cdf(t, df):
    """P(T <= t) for Student's t with df >= 1 degrees of freedom. With t = sqrt(df) tan(u), the
    tail is the integral of cos(u)^(df-1) / B(df/2, 1/2) from atan(|t| / sqrt(df)), by Simpson's
    rule over 40 / sqrt(df) at most (the rest is below e^-800 of it). It is within 2e-6 of tails
    above 1e-12 for df from 2 to 1e5, and within 1e-4 below."""
    start = math.atan(abs(t) / math.sqrt(df))
    u, h = np.linspace(start, min(math.pi / 2, start + 40 / math.sqrt(df)), 2001, retstep=True)
    f = np.cos(u) ** (df - 1)
    integral = h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    tail = integral / math.exp(math.lgamma(df / 2) + math.lgamma(0.5) - math.lgamma(df / 2 + 0.5))
    return 1 - tail if t > 0 else tail


def t_quantile(p, df):
    """The t with t_cdf(t, df) = p, to 1e-6 and for |t| below 1000, by bisect among millionths."""
    millionths = range(-10 ** 9, 10 ** 9)
    first_reaching = bisect.bisect_left(millionths, p, key=lambda i: t_cdf(i / 1e6, df))
    return millionths[first_reaching] / 1e6


def welch(a, b):
    """Welch's test of b's mean against a's: difference, standard error, df, 95 % interval, p."""
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    diff, se = float(np.mean(b) - np.mean(a)), math.sqrt(va + vb)
    if se == 0:
        return dict(diff=diff, se=se)  # each side repeats one value, so there is no test
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half_width = t_quantile(0.975, df) * se
    return dict(diff=diff, se=se, df=df, ci95=(diff - half_width, diff + half_width),
                p=2 * t_cdf(-abs(diff) / se, df))


# ==== Job files: written after every run, read back by --resume, compared by --compare =========
JOB_FORMAT = 'train_cifar10.py job, format 4'
# A job's identity, which --resume refuses to mix: what can change a run's numbers.
DATA_KEYS = ('data', 'data_digest', 'test_images')
JOB_KEYS = ('script_sha256', 'torch', 'device', 'dtype', 'compile', 'hyperparameters', 'seed',
            'train_images', *DATA_KEYS)


def write_atomically(path, data):
    """Write bytes through a part file beside path: a write cut short leaves path as it was."""
    tmp = Path(path).with_name(f'.{Path(path).name}.part')
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f'cannot write {path} ({e.strerror or e})') from None
    finally:
        tmp.unlink(missing_ok=True)


def json_ready(x):
    """x as its JSON file holds it: tuples as lists, NaN and infinity as null (strict JSON)."""
    return json.loads(json.dumps(x), parse_constant=lambda name: None)


def job_sha256(job):
    """The sha256 of a job's content, which its file holds too: one check vouches for each field."""
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()


def read_job(path, option):
    """The job file at path, as this version of the script wrote it, else a one-line UserError."""
    try:
        job = json.loads(Path(path).read_text())
        sha256 = job.pop('sha256')  # the content's, as written: one check for all the rest
        if sha256 == job_sha256(job) and job['format'] == JOB_FORMAT:
            return job
    except FileNotFoundError:
        raise UserError(f'{option} {path}: no such file') from None
    except (OSError, ValueError, AttributeError, KeyError, TypeError):  # a folder, not a JSON dict
        pass
    raise UserError(f'{option} {path} is not a job file as this version of train_cifar10.py wrote '
                    "it (another file, an older version's, cut short, or changed since by hand or "
                    'damage); left as it is')


def job_differences(a, b, keys=JOB_KEYS):
    """'name (a's -> b's)' for each setting in which two jobs differ, each hyperparameter singly.
    The numbers of images the data held override the hyperparameters of the same names."""
    def settings(job):
        hyp = job['hyperparameters'] if 'hyperparameters' in keys else {}
        return {**hyp, **{key: job[key] for key in keys if key != 'hyperparameters'}}
    a, b = ({k: 'unset' if v is None else v for k, v in settings(job).items()} for job in (a, b))
    return [f"{key} ({a.get(key, 'unset')} -> {b.get(key, 'unset')})" for key in {**a, **b}
            if a.get(key, 'unset') != b.get(key, 'unset')]


def compare_lines(paths, plot=None):
    """--compare's report: each job's accuracies, and each against the first (A) by Welch's t."""
    jobs = [read_job(path, '--compare') for path in paths]
    sides = [chr(ord('A') + i) for i in range(len(jobs))]
    lines, accuracies = [], []
    for side, path, job in zip(sides, paths, jobs):
        differences = job_differences(jobs[0], job, DATA_KEYS)
        if differences:
            raise UserError(f"--compare: {paths[0]} and {path} tested on different data, "
                            f"{', '.join(differences)}, so their accuracies are not comparable")
        acc = np.array([run['accuracy'] for run in job['runs'] if not run['failed']])
        if not len(acc):
            raise UserError(f'--compare: {path} has no finished run')
        accuracies.append(acc)
        failed = len(job['runs']) - len(acc)  # their loss was not finite: left out
        notes = f' ({failed} failed, left out)' if failed else ''
        spread = f'standard deviation {100 * acc.std(ddof=1):.2f} %' if len(acc) > 1 else 'one run'
        lines.append(f"{side}  {path}: {len(acc)} run{'s' * (len(acc) > 1)}{notes}, final "
                     f"accuracy ({evaluation_label(job['hyperparameters'])}) mean "
                     f'{100 * acc.mean():.2f} %, {spread}')
    a = accuracies[0]
    for side, job, b in list(zip(sides, jobs, accuracies))[1:]:
        differences = job_differences(jobs[0], job, [k for k in JOB_KEYS if k != 'seed'])
        lines.append(f"\n{side} differs from A in: {', '.join(differences) or 'nothing recorded'}")
        fewer = min(len(a), len(b))  # the runs of the smaller side
        test = {}
        if fewer > 1:
            test = welch(a, b)
        if not test.get('se'):  # one run on a side, or no spread
            why = 'it needs two runs on each side' if fewer < 2 else 'both repeat one accuracy'
            lines.append(f'{side} - A: {100 * (b.mean() - a.mean()):+.3f} points; no test, since '
                         f'{why}')
            continue
        low, high = test['ci95']
        lines.append(f"{side} - A: {100 * test['diff']:+.3f} points, 95 % confidence interval "
                     f"[{100 * low:+.3f}, {100 * high:+.3f}] (Welch, {test['df']:.1f} degrees of "
                     f"freedom), p = {test['p']:.2g} (two-sided)")
        if low <= 0 <= high:
            lines.append('the interval holds 0: no difference shown at the 5 % level')
        else:
            lines.append(f"{side} is {'higher' if test['diff'] > 0 else 'lower'} than A at the 5 % "
                         'level')
        minimum = 100 * test['se'] * (t_quantile(0.975, test['df']) + t_quantile(0.8, test['df']))
        caveat = ('; with fewer than 5 runs on a side, the test rests on normally distributed '
                  'accuracies, which so few cannot show') if fewer < 5 else ''
        lines.append(f'these runs would find a true difference of {minimum:.3f} points or more '
                     f'80 % of the time at the 5 % level{caveat}')
    if plot:  # --plot draws the jobs, each in a colour of its own
        plot_jobs(plot, jobs, [f'{side} {path}, ' for side, path in zip(sides, paths)])
    return lines


# ==== The command line, and main ===============================================================
AT_LEAST_ONE = ('epochs', 'batch_size', 'ema_every', 'channels', 'whitening_images',
                'augment_options', 'eval_batch_size', 'train_images', 'test_images')
# 1 makes every target uniform; reflect padding needs a pad below 32; a square fits 32 pixels.
AT_MOST = dict(label_smoothing=1, pad=31, cutout=32)
# Page's tricks, each with the setting that turns it off, for --help.
TRICKS_OFF = {'whitening': 'whitening=none', 'label smoothing': 'label_smoothing=0',
              'CELU': 'celu_alpha=0', 'ghost batch norm': 'bn_split_size=0',
              'frozen batch-norm scales': 'bn_scale_frozen=False', 'EMA': 'ema_momentum=0',
              'flip-TTA': 'flip_tta=False'}


def kind_problem(name, value):
    """Why value is not of the kind of HYP[name], by numpy's kinds, or None. A float setting takes
    any number, an integer setting integers (numpy's too), the widths as many integers as HYP's."""
    default, given = np.asarray(HYP[name]), np.asarray(value)
    kinds, what = dict(b=('b', 'True or False'), i=('iu', 'an integer'), f=('iuf', 'a number'),
                       U=('U', 'a string'))[default.dtype.kind]
    if given.dtype.kind in kinds and given.shape == default.shape:
        return None
    if default.ndim:  # the widths
        what = f'{default.size} integers'
    return f'{name}={value!r}: must be {what}, as {name}={as_typed(HYP[name])}'


def no_such_name(name):
    """Why name is refused, with the hyperparameter's name closest to it."""
    close = difflib.get_close_matches(name, HYP, 1)
    hint = f', did you mean {close[0]}?' if close else ''
    return f'no such hyperparameter{hint} (HYP lists them)'


def hyp_problem(hyp):
    """Why hyp cannot make a run, or None. A strange value is a researcher's to try (a run that
    diverges is reported as failed); one that can make no run is refused."""
    for name, value in hyp.items():
        if name not in HYP:
            return f'{name}: {no_such_name(name)}'
        why = kind_problem(name, value)
        if why:
            return why
        low = 1 if name in AT_LEAST_ONE else 0
        high = AT_MOST.get(name, sys.float_info.max)  # the largest finite float
        values = value if isinstance(value, (tuple, list)) else [value]
        if name != 'whitening' and not all(low <= float(v) <= high for v in values):
            most = f' and at most {high}' if name in AT_MOST else ''
            return f'{name}={as_typed(value)}: must be a finite number of at least {low}{most}'
    if hyp['whitening'] not in ('fixed', 'learned', 'none'):
        return f"whitening={hyp['whitening']}: must be fixed, learned or none"
    split, batch = hyp['bn_split_size'], hyp['batch_size']
    if batch % (split or 1):
        return f"batch_size={batch}: must be a multiple of ghost batch norm's split, {split}"
    return None


def as_typed(value):
    """A hyperparameter's value as --set takes it, a tuple as 64,128,256,512."""
    return ','.join(map(str, value)) if isinstance(value, tuple) else str(value)


def hyp_setting(text):
    """--set's NAME=VALUE as (NAME, VALUE): a Python literal (1,2,3 is a tuple), else the string.
    hyp_problem checks VALUE's kind with the rest of hyp."""
    name, equals, value = text.partition('=')
    if name not in HYP:
        raise UserError(f'--set {text!r}: {no_such_name(name)}')
    if not equals:
        raise UserError(f'--set {text!r}: not NAME=VALUE as {name}={as_typed(HYP[name])}')
    with contextlib.suppress(ValueError, SyntaxError):  # not a literal, as whitening=fixed
        return name, ast.literal_eval(value)
    return name, value


def parse_args(argv, defaults=None):
    """The options, a short line each (README.md's table has more). defaults: a resumed job's."""
    doc = (__doc__ or '').split('\n\n') + ['']  # the top of this file; none under python -OO
    parser = argparse.ArgumentParser(description=doc[0].split('\n')[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f'examples:\n{doc[1]}\n\nREADME.md says more.')
    parser.error = lambda why: parser.exit(2, f'error: {why}; --help lists the options\n')
    add = parser.add_argument
    add('--runs', type=int, default=1, help='runs, with seeds seed, seed+1, ... (default: 1)')
    for name in ('epochs', 'batch_size'):  # the settings changed most, as options of their own
        add(f"--{name.replace('_', '-')}", dest='set', action='append', metavar='N',
            type=lambda n, name=name: f'{name}={n}',
            help=f'as --set {name}=N (default: {HYP[name]}, --tiny {TINY[name]})')
    hyp_defaults = ' '.join(f'{name}={as_typed(value)}' for name, value in HYP.items())
    tricks = ', '.join(f'{trick} ({setting})' for trick, setting in TRICKS_OFF.items())
    add('--set', nargs='+', action='extend', metavar='NAME=VALUE',
        help=f"hyperparameters, the last value given winning. Their defaults are {hyp_defaults} "
        f"(TINY's for --tiny). Page's tricks, and the setting that turns each off: {tricks}")
    add('--seed', type=int, default=0, help='seed of the first run (default: 0)')
    add('--data-dir', default='./data', help=f'holds {BATCHES_DIR}/, or will (default: ./data)')
    add('--device', default='auto', help='auto (cuda, mps, cpu), cuda, cuda:N, mps or cpu')
    add('--dtype', default='auto', choices=['auto', 'fp16', 'fp32'],
        help='auto: fp16 on cuda, else fp32')
    add('--tiny', action='store_true', help='an install check: a subset, a narrow net, seconds')
    add('--json', metavar='PATH', help="write the job: every run's rows, the summary, the script")
    add('--save', metavar='PATH', help="save the last finished run's EMA model")
    add('--plot', metavar='PATH', help="draw the runs (or --compare's jobs): .png, .svg, .pdf")
    add('--resume', metavar='PATH', help="continue this --json file's job, in it, with its options")
    add('--compare', nargs='+', metavar='JOB', help='compare jobs with the first; trains nothing')
    add('--compile', action=argparse.BooleanOptionalAction, help='(default: on, as CUDA graphs on '
        'CUDA; off on mps and for --tiny): a minute or less, once, before the first run')
    parser.set_defaults(**{'set': [], **(defaults or {})})
    return parser.parse_args(argv)


def in_notebook_cell():
    """Whether this runs in a notebook cell (Colab, Jupyter), where sys.argv is the kernel's."""
    return os.path.basename(sys.argv[0]).endswith('kernel_launcher.py')


def check_options(args, hyp, resumed_save=None):
    """Refuse in one line, before any work, what cannot make a sensible job: settings and paths."""
    why = hyp_problem(hyp)
    if why:
        raise UserError(f'--set {why}')
    for flag in ('--json', '--resume', '--save', '--plot'):
        path, why = getattr(args, flag[2:]), None
        folder = os.path.dirname(path or '') or '.'
        if path is None:
            continue
        if not path or os.path.isdir(path):
            why = 'a folder or nothing (an unset shell variable?): give a file name'
        elif not (os.path.isdir(folder) and os.access(folder, os.W_OK)):  # files go beside it
            why = f'its folder {folder} is missing or not writable'
        elif flag == '--resume' and not os.path.exists(path):
            why = 'no such file (a new job starts with --json)'
        elif flag == '--plot' and not importlib.util.find_spec('matplotlib'):
            why = 'needs matplotlib: pip install matplotlib'
        elif flag in ('--json', '--save') and path != resumed_save and os.path.exists(path):
            why = 'exists, and a new job overwrites no file: give another path, or --resume its job'
        if why:
            raise UserError(f'{flag} {path!r}: {why}')


class Job:
    """One command's runs and the files rewritten after each; main() calls set_up, run_all, end."""

    def __init__(self, args, argv=()):
        self.args, self.argv = args, argv  # as parsed, and as given
        self.path = args.resume or args.json  # the job file: a resumed job goes on writing its own
        self.runs, self.runs_resumed = [], 0  # the finished runs in order, and those read back
        self.trainer = self.started = None  # the networks, and when the first run started

    def set_up(self):
        """Check what can be refused before any training, then read back a resumed job's runs."""
        resumed = None
        if self.args.resume and os.path.isfile(self.path):
            resumed = read_job(self.path, '--resume')
            self.args = parse_args(self.argv, resumed['options'])  # those given here win
        args = self.args
        settings = dict(hyp_setting(text) for text in args.set)  # the last value of each
        self.hyp = hyp = hyperparameters(settings, args.tiny)
        resumed_save = resumed['options']['save'] if resumed else None  # rewritten, not refused
        check_options(args, hyp, resumed_save)
        self.device = device = pick_device(args.device)
        self.compile_mode = pick_compile_mode(args.compile, device, args.tiny)
        self.dtype = pick_dtype(args.dtype, device)
        data = load_cifar10(ensure_cifar10(args.data_dir))
        self.data = first_images(data, hyp)  # all the data holds, or fewer (--tiny, --set)
        script, self.script, script_sha256 = globals().get('__file__'), None, 'n/a'
        if script and os.path.isfile(script):  # a notebook cell has no file
            text = Path(script).read_bytes()
            self.script, script_sha256 = text.decode(), hashlib.sha256(text).hexdigest()[:16]
        self.identity = dict(  # what the header, --resume and --compare read
            script_sha256=script_sha256, torch=torch.__version__,
            device=device_description(device), dtype=str(self.dtype), compile=self.compile_mode,
            hyperparameters=hyp, seed=args.seed, data=data['provenance'],
            data_digest=data['digest'], train_images=len(self.data['train_images']),
            test_images=len(self.data['test_images']))
        if resumed:
            differences = job_differences(resumed, json_ready(self.identity))
            if differences:
                raise UserError(f"--resume {self.path}: that job differs from this one in "
                                f"{', '.join(differences)}, that job's -> this one's: resume it "
                                'with the script, kind of device and options it began with, or '
                                'give a new job its own --json')
            self.runs, self.runs_resumed = resumed['runs'], len(resumed['runs'])

    def run_all(self):
        """The header, the runs read back, the warm-up, then each missing run, kept as it ends."""
        args = self.args
        print('\n'.join(header_lines(self.identity)))
        if self.runs:
            print(f'\n{len(self.runs)} run(s) read back from {args.resume}')
        missing = sorted(set(range(1, args.runs + 1)) - {run['run'] for run in self.runs})
        if not missing:
            return
        compiling = 'compilation, then ' if self.compile_mode else ''
        print(f'\n{compiling}warm-up: untimed runs of 2 steps take the one-off costs', flush=True)
        with torch_settings(self.device, self.compile_mode):
            self.trainer = trainer_for(self.data, self.hyp, self.device, self.dtype,
                                       self.compile_mode, print)
            test_set = upload_test_set(self.data, self.trainer)
            self.started = time.perf_counter()
            for run in missing:
                seed = args.seed + run - 1
                on_epoch = table_printer(run, args.runs, seed)
                rows = train_run(self.data, test_set, self.trainer, self.hyp, seed, on_epoch)
                self.record_run(dict(run=run, seed=seed, failed=diverged(rows), rows=rows,
                                     accuracy=rows[-1]['valid_acc'], time_s=rows[-1]['total_time']))

    def record_run(self, record):
        """Write a finished run to the job file, then hold it, save its EMA model to --save's file,
        and say when a job whose runs take minutes should end."""
        runs = sorted([*self.runs, record], key=lambda run: run['run'])
        self.recorded_at = time.perf_counter()
        if self.path:
            files = ('json', 'resume', 'plot')  # not the job's settings
            options = {k: v for k, v in vars(self.args).items() if k not in files}
            job = {'format': JOB_FORMAT, **json_ready(dict(
                self.identity, options=options, runs_finished=len(runs),
                runs_requested=self.args.runs, runs=runs, summary=self.summary(runs),
                script=self.script))}
            text = json.dumps({**job, 'sha256': job_sha256(job)}, indent=1)
            write_atomically(self.path, text.encode())
        self.runs = runs
        if self.args.save and not record['failed']:
            model = trained_model(self.trainer, self.hyp, self.data)
            save_model(model, self.args.save, run=record['run'], seed=record['seed'],
                       accuracy=record['accuracy'])
        per_run = (self.recorded_at - self.started) / (len(runs) - self.runs_resumed)
        left = self.args.runs - len(runs)
        if left and per_run > 60:
            end = datetime.datetime.now() + datetime.timedelta(seconds=per_run * left)
            print(f'\n{left} run(s) left, {per_run / 60:.1f} min each: the job should end at '
                  f'about {end:%H:%M on %a %d %b}', flush=True)

    def summary(self, runs):
        """The summary of runs (read back too), and the pace of those trained here."""
        summary = summarize(runs, self.hyp)
        trained = len(runs) - self.runs_resumed
        if trained:
            summary.update(trained=trained, wall_s=self.recorded_at - self.started)
        return summary

    def end(self, status):
        """Say what a stopped job left, print the summary and draw --plot, with Ctrl-C ignored.
        Returns the status, or 1 if --plot was not drawn."""
        ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if status == 130:
                then = f'; --resume {self.path} goes on' if self.runs and self.path else ''
                print(f'\ninterrupted after {len(self.runs)} finished run(s){then}')
            if self.runs:
                print('\n' + '\n'.join(summary_lines(self.summary(self.runs))))
            if self.args.plot and (self.runs or self.started is not None):
                job = dict(self.identity, options=vars(self.args), runs=self.runs)
                try:
                    plot_jobs(self.args.plot, [job])
                except Exception as e:  # a full disk, or TeX failing for a .pgf: the job is whole
                    why = str(e).strip().split('\n')[0]
                    print(f'error: --plot {self.args.plot} not drawn: {why}', file=sys.stderr)
                    return status or 1
            return status
        finally:
            signal.signal(signal.SIGINT, ignored)


def main(argv=None):
    """Train --runs models, print the tables and the summary, and return the exit status."""
    if argv is None:
        argv = [] if in_notebook_cell() else sys.argv[1:]
    try:
        args = parse_args(argv)
    except SystemExit as e:  # a usage error (2) or --help (0) as a status, in a notebook too
        return e.code
    job = Job(args, argv)
    status = 0
    try:
        if args.compare:  # trains nothing: print the comparison of the jobs
            check_options(args, HYP)  # --plot's path
            print('\n'.join(compare_lines(args.compare, args.plot)))
            return 0
        job.set_up()
        job.run_all()
    except UserError as e:
        print(f'error: {e}', file=sys.stderr)
        status = 1
    except KeyboardInterrupt:  # Ctrl-C
        status = 130
    finally:
        status = job.end(status)
    unfinished = len(job.runs) < job.args.runs or any(run['failed'] for run in job.runs)
    return status or int(unfinished)


if __name__ == '__main__':
    if hasattr(signal, 'SIGPIPE'):  # the reader left (| head): stop quietly, as Unix tools do
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    status = main()
    if status and not in_notebook_cell():  # SystemExit in a cell would print a traceback
        sys.exit(status)
