"""Train a forecaster on one 500k-sample series, end to end.

The series is a Mackey-Glass delay system (chaotic, tau = 17) with observation noise,
generated locally and seeded. The model reads the series causally, one sample per step,
through stacked recurrent layers (`pscan.nn.Recurrence`), and predicts the value
`--horizon` steps ahead from each step's output with a linear readout. Each training
step is one gradient over the whole 450k-step training part; the last 10% is held out
for validation (the model sees it only as the continuation of the same sequence).

Models (`--model`):

- `lru`: LRU layers (complex diagonal, linear: one `pscan.linear_recurrence` each);
- `mingru`: minGRU layers (linear in the state as well);
- `gru`: `eqx.nn.GRUCell` layers, nonlinear: `--solver` picks how they are solved
  (`default`: exact checkpointed `lax.scan` on CPU, chunked Newton on GPU; `newton`:
  `pscan.Newton(chunk_size=128)`; `sequential`: `pscan.Sequential()`).

After training it prints the validation loss beside fair baselines fitted on the same
split (the training mean, the last value, a least-squares linear autoregression of 32
lags), then generates `--forecast` samples beyond the training data free-running: the
layers read the observed series in parallel, then carry their state (`return_state`)
and run one step at a time (`Recurrence.step`), fed the model's own forecasts; the same
against the iterated linear model. `--packed K` trains instead on K series of
different lengths (their own seeds and delays) packed into one sequence with `resets`:
one gradient over all of them, each series from the initial state.

Writes the loss curve and the forecasts against the truth as PNG files.

    python examples/train_long_series.py                     # LRU, 500k samples, ~2 min on 2 cores
    python examples/train_long_series.py --model gru --solver newton --length 50000
    python examples/train_long_series.py --packed 16         # 16 series, packed
"""

import argparse
import math
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import pscan
import pscan.nn as nn


def mackey_glass(length, tau=17, beta=0.2, gamma=0.1, power=10, noise=0.02, seed=0):
    """`x[t+1] = x[t] + beta x[t-tau] / (1 + x[t-tau]^power) - gamma x[t]`, plus noise,
    standardised. float32, shape `(length,)`."""
    rng = np.random.default_rng(seed)
    burn = 1000
    x = np.empty(length + burn + tau)
    x[: tau + 1] = 1.2 + 0.1 * rng.standard_normal(tau + 1)
    for t in range(tau, length + burn + tau - 1):
        lagged = x[t - tau]
        x[t + 1] = x[t] + beta * lagged / (1 + lagged**power) - gamma * x[t]
    x = x[burn + tau :]
    x = x + noise * rng.standard_normal(length)
    return ((x - x.mean()) / x.std()).astype(np.float32)


SOLVERS = {
    "default": None,
    "newton": pscan.Newton(chunk_size=128, rtol=1e-5, atol=1e-5, max_iters=50),
    "sequential": pscan.Sequential(),
}


class Forecaster(eqx.Module):
    """Linear encoder, recurrent layers with residual connections, linear readout.

    `model(xs)` reads a whole series in parallel; `model.step(x, states)` reads one
    more sample with the same layers (their `step`), for free-running generation."""

    encoder: eqx.nn.Linear
    layers: list[nn.Recurrence]
    head: eqx.nn.Linear

    def __init__(self, model, hidden, depth, solver, *, key):
        keys = jax.random.split(key, depth + 2)
        self.encoder = eqx.nn.Linear(1, hidden, key=keys[0])
        cells = {
            "lru": lambda k: nn.LRU(hidden, hidden, r_min=0.9, r_max=0.999, key=k),
            "mingru": lambda k: nn.MinGRU(hidden, hidden, key=k),
            "gru": lambda k: eqx.nn.GRUCell(hidden, hidden, key=k),
        }[model]
        self.layers = [
            nn.Recurrence(cells(k), solver, return_state=True) for k in keys[1:-1]
        ]
        self.head = eqx.nn.Linear(hidden, 1, key=keys[-1])

    def __call__(self, xs, states=None, resets=None):
        """`xs` of shape `(T,)` -> `(forecasts (T,), final states)`; `resets` marks
        where the series of a packed batch start."""
        u = jax.vmap(self.encoder)(xs[:, None])
        states = [None] * len(self.layers) if states is None else states
        finals = []
        for layer, h in zip(self.layers, states):
            y, h = layer(u, h, resets=resets)
            u = u + jax.nn.gelu(y)
            finals.append(h)
        return jax.vmap(self.head)(u)[:, 0], finals

    def step(self, x, states):
        """One more sample `x` (a scalar) -> `(forecast, new states)`."""
        u = self.encoder(x[None])
        new = []
        for layer, h in zip(self.layers, states):
            y, h = layer.step(u, h)
            u = u + jax.nn.gelu(y)
            new.append(h)
        return self.head(u)[0], new


def free_run(model, observed, steps, horizon):
    """Generate `steps` samples after `observed`, feeding the model's own forecasts
    back: the whole observed part in parallel (its forecasts of the next `horizon`
    samples and the layers' final states), then one `step` per sample, each fed the
    forecast of that sample made `horizon` steps earlier."""
    forecasts, states = model(observed)
    pending = forecasts[-horizon:]  # forecasts of the next `horizon` samples

    def one(carry, _):
        pending, states = carry
        x = pending[0]
        y, states = model.step(x, states)
        return (jnp.concatenate([pending[1:], y[None]]), states), x

    return jax.lax.scan(one, (pending, states), None, length=steps)[1]


def lagged(series, order):
    """Rows `[x[t-order+1], ..., x[t]]` for `t >= order - 1`."""
    windows = np.lib.stride_tricks.sliding_window_view(series, order)
    return np.concatenate([windows, np.ones((len(windows), 1), series.dtype)], 1)


class LinearAR:
    """Least-squares linear autoregression of order `order` on the training part: a
    direct `horizon`-step forecaster (the model's task) and a one-step model iterated
    on its own outputs (free-running, as the model generates)."""

    def __init__(self, series, stop, horizon, order=32):
        self.order, self.horizon = order, horizon
        x = lagged(series[: stop + horizon], order)
        # forecasts made at t < stop, of x[t + horizon] and of x[t + 1]
        self.direct = np.linalg.lstsq(
            x[: stop - order + 1], series[order - 1 + horizon : stop + horizon], None
        )[0]
        self.one = np.linalg.lstsq(
            x[: stop - order + 1], series[order : stop + 1], None
        )[0]

    def forecast(self, series):
        """Direct forecasts of `x[t + horizon]` for `t >= order - 1`."""
        return lagged(series, self.order) @ self.direct

    def free_run(self, observed, steps):
        window = list(observed[-self.order :])
        out = []
        for _ in range(steps):
            out.append(
                float(np.dot(window[-self.order :], self.one[:-1]) + self.one[-1])
            )
            window.append(out[-1])
        return np.array(out)


def packed_series(length, count, seed):
    """`count` Mackey-Glass series with their own seeds and delays, of lengths drawn
    between `length / (4 count)` and `2 length / count`, packed: `(series, starts)`."""
    rng = np.random.default_rng(seed)
    sizes = rng.uniform(0.25, 2.0, count)
    sizes = np.maximum(np.round(sizes / sizes.sum() * length).astype(int), 64)
    parts = [
        mackey_glass(int(n), tau=int(rng.integers(14, 24)), seed=seed + 1 + i)
        for i, n in enumerate(sizes)
    ]
    return np.concatenate(parts), np.cumsum([0, *sizes[:-1]])


def make_loss(horizon):
    def loss(model, series, mask, resets=None):
        """Mean squared error of the forecasts made at the steps where `mask`."""
        resets = None if resets is None else resets[:-horizon]
        pred = model(series[:-horizon], resets=resets)[0]
        err = (pred - series[horizon:]) ** 2
        return jnp.sum(jnp.where(mask, err, 0)) / jnp.sum(mask)

    return loss


def split_masks(length, horizon, starts):
    """Per forecast step `t < length - horizon`: `(train, validation, cut)`. Each
    series (from `starts`) keeps the forecasts whose target lies in it; the first 90%
    of them train, the rest validate; `cut` is where the last series' validation
    forecasts start."""
    t = np.arange(length - horizon)
    train = np.zeros(len(t), bool)
    val = np.zeros(len(t), bool)
    for s, e in zip(starts, [*starts[1:], length]):
        n = e - s - horizon
        cut = s + int(0.9 * n)
        train |= (t >= s) & (t < cut)
        val |= (t >= cut) & (t < s + n)
    return train, val, cut


def plot(history, truth, forecasts, horizon, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, train, val = zip(*history)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(steps, train, label="training")
    ax.semilogy(
        [s for s, _, v in history if v is not None],
        [v for _, _, v in history if v is not None],
        "o-",
        label="validation",
    )
    ax.set_xlabel("step")
    ax.set_ylabel(f"MSE, {horizon} steps ahead")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "train_loss.png", dpi=120)

    fig, axes = plt.subplots(len(forecasts), 1, figsize=(8, 6), sharex=True)
    t = np.arange(len(truth))
    for ax, (title, lines) in zip(axes, forecasts.items()):
        ax.plot(t, truth, label="truth", lw=1.5, color="k")
        for label, values in lines.items():
            ax.plot(t, values, label=label, lw=1.1)
        ax.set_title(title, fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("samples after the training data")
    fig.tight_layout()
    fig.savefig(out_dir / "train_prediction.png", dpi=120)
    print(
        f"plots written to {out_dir / 'train_loss.png'} and "
        f"{out_dir / 'train_prediction.png'}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=500_000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--model", choices=["lru", "mingru", "gru"], default="lru")
    parser.add_argument("--solver", choices=list(SOLVERS), default="default")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--horizon", type=int, default=20)
    parser.add_argument("--forecast", type=int, default=300)
    parser.add_argument(
        "--packed",
        type=int,
        default=0,
        help="train on this many series of different lengths, packed with resets",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args()
    horizon = args.horizon

    start = time.perf_counter()
    if args.packed:
        raw, starts = packed_series(args.length, args.packed, args.seed)
        resets = np.zeros(len(raw), bool)
        resets[starts] = True
        what = f"{args.packed} series packed with resets, {len(raw)} samples"
    else:
        raw, starts, resets = mackey_glass(args.length, seed=args.seed), [0], None
        what = f"one series of {len(raw)} samples"
    series = jnp.asarray(raw)
    train, val, cut = split_masks(len(raw), horizon, starts)
    print(
        f"{what} ({time.perf_counter() - start:.1f} s to generate); "
        f"{train.sum()} training forecasts, {val.sum()} validation ones; model "
        f"{args.model}, solver {args.solver}, backend {jax.default_backend()}"
    )

    model = Forecaster(
        args.model,
        args.hidden,
        args.depth,
        SOLVERS[args.solver],
        key=jax.random.PRNGKey(args.seed),
    )
    schedule = optax.cosine_decay_schedule(args.lr, max(args.steps, 1), alpha=0.1)
    optimiser = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))
    loss = make_loss(horizon)

    @eqx.filter_jit
    def train_step(model, opt_state):
        value, grads = eqx.filter_value_and_grad(loss)(model, series, train, resets)
        updates, opt_state = optimiser.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    validate = eqx.filter_jit(lambda model: loss(model, series, val, resets))

    start = time.perf_counter()
    model_c, _, _ = train_step(model, opt_state)  # compile
    float(validate(model))
    print(f"compiled in {time.perf_counter() - start:.1f} s")
    history = []
    start = time.perf_counter()
    with tqdm(range(args.steps), desc="training", unit="step") as bar:
        for step in bar:
            model, opt_state, value = train_step(model, opt_state)
            val_loss = None
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                val_loss = float(validate(model))
            history.append((step + 1, float(value), val_loss))
            bar.set_postfix(
                train=f"{float(value):.4f}",
                val="-" if val_loss is None else f"{val_loss:.4f}",
            )
    elapsed = time.perf_counter() - start
    final = history[-1][2] if history else float(validate(model))
    print(
        f"{args.steps} steps in {elapsed:.1f} s ({elapsed / max(args.steps, 1):.2f} s "
        f"per gradient over {len(raw) - horizon} steps)"
    )
    if not math.isfinite(final):
        raise SystemExit("training diverged")

    # Baselines on the same split, fitted on the training part of the last series
    # (the whole series unless packed): its mean, the last value, and a linear
    # autoregression (least squares, 32 lags)
    last = raw[starts[-1] :]
    stop = cut - starts[-1]  # the forecasts made before it train
    ar = LinearAR(last, stop, horizon)
    targets = last[horizon:]
    mask = val[starts[-1] :]
    mean = float(last[:stop].mean())
    direct = np.full(len(targets), np.nan)
    direct[ar.order - 1 :] = ar.forecast(last[:-horizon])
    mse = lambda pred: float(np.mean((pred[mask] - targets[mask]) ** 2))
    print(
        f"validation loss {final:.4f} (MSE of standardised values, {horizon} steps "
        f"ahead); on the last series' validation part the training mean gives "
        f"{mse(np.full(len(targets), mean)):.4f}, repeating the last value "
        f"{mse(last[:-horizon]):.4f}, a linear AR(32) {mse(direct):.4f}"
    )

    # Free-running: from the end of the last series' training data, the model
    # generates step by step from its carried state, fed its own forecasts
    observed = last[: stop + horizon]
    steps = min(args.forecast, len(last) - len(observed))
    truth = last[len(observed) : len(observed) + steps]
    run = eqx.filter_jit(free_run)  # `steps` and `horizon` are static ints
    generated = np.asarray(run(model, jnp.asarray(observed), steps, horizon))
    ar_run = ar.free_run(observed, steps)
    first = min(100, steps)
    for n in sorted({first, steps}):
        err = lambda pred, n=n: float(np.mean((pred[:n] - truth[:n]) ** 2))
        print(
            f"free-running forecast of {n} samples beyond the training data: MSE "
            f"{err(generated):.4f} (the training mean "
            f"{err(np.full(steps, mean)):.4f}, a linear AR(32) iterated "
            f"{err(ar_run):.4f})"
        )
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if history:
        # forecasts of the generated samples made `horizon` steps earlier from the
        # true series (the task trained on), beside the free-running ones
        one_pass = np.asarray(eqx.filter_jit(model)(jnp.asarray(last))[0])
        made = slice(len(observed) - horizon, len(observed) - horizon + steps)
        forecasts = {
            f"forecasts made {horizon} steps earlier from the true series": {
                "model": one_pass[made],
                "linear AR(32)": direct[made],
            },
            "free-running: each model fed its own forecasts": {
                "model": generated,
                "linear AR(32), iterated": ar_run,
            },
        }
        plot(history, truth, forecasts, horizon, out_dir)
    del model_c


if __name__ == "__main__":
    main()
