"""Pictures for humans: captioned sample grids and loss curves, written as PNG files.

Both work offline and headless: the grid uses PIL's built-in font, the plot uses matplotlib's Agg canvas
directly (no pyplot, so no global figure state and no backend switch for the caller).
"""

import json
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

_MIN_CELL = 128  # tiny images are upscaled (nearest neighbour) to at least this many pixels
_PAD = 6  # pixels between cells and around captions
_FONT_SIZE = 11


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Images [..., 3] as uint8: uint8 passes through, floats are read as [-1, 1] and clipped."""
    x = np.asarray(images)
    if x.dtype == np.uint8:
        return x
    x = np.clip((x.astype(np.float32) + 1.0) * 127.5, 0.0, 255.0)
    return np.rint(x).astype(np.uint8)


def _wrap(text: str, font: ImageFont.ImageFont, width: int, draw: ImageDraw.ImageDraw) -> list[str]:
    """Greedy word wrap of `text` to lines at most `width` pixels wide (a too-long word gets its own line)."""
    lines: list[str] = []
    for word in text.split():
        trial = f"{lines[-1]} {word}" if lines else word
        if lines and draw.textlength(trial, font=font) <= width:
            lines[-1] = trial
        else:
            lines.append(word)
    return lines


def make_sample_grid(
    images: np.ndarray, captions: Sequence[str], cols: int | None = None, upscale: int | None = None
) -> Image.Image:
    """Returns an RGB PIL image: images in a grid, each caption word-wrapped under its image.

    Args:
      images: [N, H, W, 3], float in [-1, 1] or uint8.
      captions: N strings (an empty list gives no caption rows).
      cols: images per row; default ceil(sqrt(N)).
      upscale: integer nearest-neighbour zoom; default the smallest that makes cells >= 128 px wide.
    """
    imgs = to_uint8(images)
    if imgs.ndim != 4 or imgs.shape[-1] != 3:
        raise ValueError(f"images must be [N, H, W, 3], got shape {imgs.shape}")
    n, h, w, _ = imgs.shape
    if captions and len(captions) != n:
        raise ValueError(f"{len(captions)} captions for {n} images")
    if n == 0:
        raise ValueError("no images to draw")
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    zoom = upscale or max(1, math.ceil(_MIN_CELL / max(h, w)))
    cw, ch = w * zoom, h * zoom

    font = ImageFont.load_default(size=_FONT_SIZE)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    wrapped = [_wrap(c, font, cw, measure) for c in captions] if captions else [[] for _ in range(n)]
    ascent, descent = font.getmetrics()
    line_h = ascent + descent + 1
    text_h = max(len(lines) for lines in wrapped) * line_h + (_PAD if captions else 0)

    grid = Image.new("RGB", (cols * (cw + _PAD) + _PAD, rows * (ch + text_h + _PAD) + _PAD), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(n):
        x = _PAD + (i % cols) * (cw + _PAD)
        y = _PAD + (i // cols) * (ch + text_h + _PAD)
        grid.paste(Image.fromarray(imgs[i]).resize((cw, ch), Image.Resampling.NEAREST), (x, y))
        for k, line in enumerate(wrapped[i]):
            draw.text((x, y + ch + _PAD // 2 + k * line_h), line, fill="black", font=font)
    return grid


def save_sample_grid(
    path: str | os.PathLike,
    images: np.ndarray,
    captions: Sequence[str],
    cols: int | None = None,
    upscale: int | None = None,
) -> tuple[int, int]:
    """Writes `make_sample_grid(...)` of the same arguments as a PNG at `path`; returns (width, height)."""
    grid = make_sample_grid(images, captions, cols, upscale)
    grid.save(os.fspath(path), format="PNG")
    return grid.size


def save_checked_grid(
    path: str | os.PathLike,
    images: np.ndarray,
    captions: Sequence[str],
    checks: Sequence[Mapping[str, tuple[int, int]]],
    cols: int | None = None,
) -> tuple[int, int]:
    """A sample grid whose every cell shows how its caption was read: a frame (green when every check passed,
    red otherwise) and, under the caption, one word per checked attribute in green (all passed), orange (some)
    or red (none), with "passed/total" where the caption states several objects. Writes a PNG at `path`.

    Args:
      images: [N, H, W, 3], float in [-1, 1] or uint8; captions: N strings.
      checks: per image, attribute -> (checks passed, checks made) (alignment.check_batch, one row each).
    Returns the PNG's (width, height).
    """
    imgs = to_uint8(images)
    n, h, w, _ = imgs.shape
    if not (len(captions) == len(checks) == n):
        raise ValueError(f"{n} images, {len(captions)} captions and {len(checks)} check rows")
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    zoom = max(1, math.ceil(_MIN_CELL / max(h, w)))
    cw, ch, frame = w * zoom, h * zoom, 3
    font = ImageFont.load_default(size=_FONT_SIZE)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    wrapped = [_wrap(c, font, cw, measure) for c in captions]
    ascent, descent = font.getmetrics()
    line_h = ascent + descent + 1
    marks = [[(a if p == t else f"{a} {p}/{t}", p, t) for a, (p, t) in c.items()] for c in checks]
    mark_lines = [_wrap(" ".join(m[0] for m in row), font, cw, measure) for row in marks]
    text_h = max(len(a) + len(b) for a, b in zip(wrapped, mark_lines, strict=True)) * line_h + _PAD
    cell_w, cell_h = cw + 2 * frame, ch + 2 * frame + text_h
    grid = Image.new("RGB", (cols * (cell_w + _PAD) + _PAD, rows * (cell_h + _PAD) + _PAD), "white")
    draw = ImageDraw.Draw(grid)
    colors = {"all": (20, 150, 40), "some": (220, 130, 0), "none": (200, 20, 20)}
    for i in range(n):
        x = _PAD + (i % cols) * (cell_w + _PAD)
        y = _PAD + (i // cols) * (cell_h + _PAD)
        exact = all(p == t for _, p, t in marks[i])
        draw.rectangle([x, y, x + cell_w - 1, y + ch + 2 * frame - 1], fill=colors["all" if exact else "none"])
        grid.paste(Image.fromarray(imgs[i]).resize((cw, ch), Image.Resampling.NEAREST), (x + frame, y + frame))
        ty = y + ch + 2 * frame + _PAD // 2
        for k, line in enumerate(wrapped[i]):
            draw.text((x, ty + k * line_h), line, fill="black", font=font)
        # The marks, word by word, each in its own color, wrapped like the caption.
        ty += len(wrapped[i]) * line_h
        tx, row = x, 0
        for word, p, t in marks[i]:
            width = draw.textlength(word + " ", font=font)
            if tx > x and tx + draw.textlength(word, font=font) > x + cw:
                tx, row = x, row + 1
            kind = "all" if p == t else ("some" if p else "none")
            draw.text((tx, ty + row * line_h), word, fill=colors[kind], font=font)
            tx += width
    grid.save(os.fspath(path), format="PNG")
    return grid.size


def _read_metrics(metrics: str | os.PathLike | Sequence[Mapping]) -> list[Mapping]:
    if isinstance(metrics, str | os.PathLike):
        with open(metrics) as f:
            return [json.loads(line) for line in f if line.strip()]
    return list(metrics)


def ema_smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """Bias-corrected exponential moving average (TensorBoard-style); non-finite values are skipped."""
    out = np.empty(len(values), np.float64)
    acc, norm = 0.0, 0.0
    for i, v in enumerate(values):
        if np.isfinite(v):
            acc = weight * acc + (1.0 - weight) * v
            norm = weight * norm + (1.0 - weight)
        out[i] = acc / norm if norm > 0 else np.nan
    return out


def save_loss_plot(
    path: str | os.PathLike,
    metrics: str | os.PathLike | Sequence[Mapping],
    key: str = "loss",
    smooth: float = 0.9,
    logy: bool = False,
) -> int:
    """Plots `key` (raw and EMA-smoothed) against "step" into a PNG at `path`.

    Args:
      metrics: a metrics.jsonl path (one JSON object per line) or a list of dicts; entries without both
        "step" and `key` are skipped (e.g. eval-only lines).
      smooth: EMA weight of the smoothed curve in [0, 1).
      logy: log-scale y axis.
    Returns the number of points plotted; raises ValueError when there are none.
    """
    # Imported here so that importing reve_jax.viz (e.g. for the grid) does not pay for matplotlib.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [m for m in _read_metrics(metrics) if key in m and "step" in m]
    if not rows:
        raise ValueError(f"no metrics with both 'step' and {key!r} to plot")
    rows.sort(key=lambda m: m["step"])
    steps = np.array([float(m["step"]) for m in rows])
    values = np.array([float(m[key]) for m in rows])

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, values, color="tab:blue", alpha=0.35, linewidth=1, label=key)
    ax.plot(steps, ema_smooth(values, smooth), color="tab:blue", linewidth=2, label=f"{key} (EMA {smooth})")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
    return len(rows)
