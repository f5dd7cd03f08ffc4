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

Writes the loss curve and prediction-vs-truth plots as PNG files.

    python examples/train_long_series.py                     # LRU, 500k samples, ~2 min on 2 cores
    python examples/train_long_series.py --model gru --solver newton --length 50000
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
    """Linear encoder, recurrent layers with residual connections, linear readout."""

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
        self.layers = [nn.Recurrence(cells(k), solver) for k in keys[1:-1]]
        self.head = eqx.nn.Linear(hidden, 1, key=keys[-1])

    def __call__(self, xs):
        """`xs` of shape `(T,)` -> forecasts `(T,)`."""
        u = jax.vmap(self.encoder)(xs[:, None])
        for layer in self.layers:
            u = u + jax.nn.gelu(layer(u))
        return jax.vmap(self.head)(u)[:, 0]


def make_loss(horizon):
    def loss(model, series, start, stop):
        """Mean squared error of the forecasts made at steps `start <= t < stop`."""
        pred = model(series[:-horizon])
        err = (pred - series[horizon:]) ** 2
        t = jnp.arange(err.shape[0])
        mask = (t >= start) & (t < stop)
        return jnp.sum(jnp.where(mask, err, 0)) / jnp.sum(mask)

    return loss


def plot(history, series, prediction, horizon, split, out_dir):
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

    window = slice(split, split + 1500)
    t = np.arange(len(series))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(t[window], series[window], label="truth", lw=1.5)
    ax.plot(
        t[window],
        prediction[window.start - horizon : window.stop - horizon],
        label=f"forecast made {horizon} steps earlier",
        lw=1.2,
    )
    ax.set_xlabel("sample (validation part)")
    ax.legend(loc="upper right")
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
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args()

    start = time.perf_counter()
    series = jnp.asarray(mackey_glass(args.length, seed=args.seed))
    n = args.length - args.horizon
    split = int(0.9 * n)
    print(
        f"series: {args.length} samples ({time.perf_counter() - start:.1f} s to "
        f"generate); training on forecasts from steps [0, {split}), validating on "
        f"[{split}, {n}); model {args.model}, solver {args.solver}, "
        f"backend {jax.default_backend()}"
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
    loss = make_loss(args.horizon)

    @eqx.filter_jit
    def train_step(model, opt_state):
        value, grads = eqx.filter_value_and_grad(loss)(model, series, 0, split)
        updates, opt_state = optimiser.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    validate = eqx.filter_jit(lambda model: loss(model, series, split, n))

    start = time.perf_counter()
    model_c, _, _ = train_step(model, opt_state)  # compile
    float(validate(model))
    print(f"compiled in {time.perf_counter() - start:.1f} s")
    history = []
    baseline = float(
        jnp.mean(
            (series[args.horizon :][split:n] - series[: -args.horizon][split:n]) ** 2
        )
    )
    start = time.perf_counter()
    with tqdm(range(args.steps), desc="training", unit="step") as bar:
        for step in bar:
            model, opt_state, value = train_step(model, opt_state)
            val = None
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                val = float(validate(model))
            history.append((step + 1, float(value), val))
            bar.set_postfix(
                train=f"{float(value):.4f}", val="-" if val is None else f"{val:.4f}"
            )
    elapsed = time.perf_counter() - start
    final = history[-1][2] if history else float(validate(model))
    print(
        f"{args.steps} steps in {elapsed:.1f} s ({elapsed / max(args.steps, 1):.2f} s "
        f"per gradient over {split} steps)"
    )
    print(
        f"validation loss {final:.4f} (MSE of standardised values; repeating the last "
        f"value gives {baseline:.4f})"
    )
    if not math.isfinite(final):
        raise SystemExit("training diverged")
    prediction = np.asarray(eqx.filter_jit(model)(series[: -args.horizon]))
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if history:
        plot(history, np.asarray(series), prediction, args.horizon, split, out_dir)
    del model_c


if __name__ == "__main__":
    main()
