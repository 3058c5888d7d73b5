//! Summing devices' gradients into a key's merge buffer, and keeping a
//! float16 key's value what MXNet would hold: the arithmetic every store's
//! push shares, so that the same gradients give the same bits on each.

use crate::codec::Grad;
use crate::optimizer::Optimizer;
use crate::par;

/// Rounds each element to the nearest float16, kept in float32: how a
/// float16 key's value stays what MXNet would hold.
pub(crate) fn round_to_f16(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = half::f16::from_f32(*v).to_f32());
}

/// After an update or a sum became a float16 key's value: rounded to
/// float16, unless the optimizer keeps a float32 master copy
/// (`multi_precision`), which pulls round instead.
pub(crate) fn settle(value: &mut [f32], half: bool, optimizer: Option<&Optimizer>) {
    if half && !optimizer.is_some_and(|o| o.multi_precision()) {
        round_to_f16(value);
    }
}

/// `dst = grads[0] + grads[1] + ...` in float32 (half-precision gradients
/// widened exactly), left to right per element, in parallel chunks. With
/// `half` (a float16 key) each partial sum is rounded to float16, as MXNet
/// adds float16 arrays.
pub(crate) fn sum_into(dst: &mut [f32], grads: &[Grad], half: bool) {
    let chunk = |offset: usize, d: &mut [f32]| {
        let range = offset..offset + d.len();
        for (i, g) in grads.iter().enumerate() {
            match g.slice(range.clone()) {
                Grad::F32(g) => add_into(d, g, i == 0, half, |y| y),
                Grad::F16(g) => add_into(d, g, i == 0, half, half::f16::to_f32),
                Grad::Bf16(g) => add_into(d, g, i == 0, half, half::bf16::to_f32),
            }
        }
    };
    par::chunks(dst, chunk);
}

/// `d = g` (`first`), else `d += g`, widened; with `half` each sum rounded
/// to float16. One loop per case, so none tests a flag per element.
/// The devices' sum here, and a server's sum of float32 pushes.
#[inline(always)]
pub(crate) fn add_into<T: Copy>(d: &mut [f32], g: &[T], first: bool, half: bool, widen: impl Fn(T) -> f32) {
    let pairs = d.iter_mut().zip(g);
    match (first, half) {
        (true, _) => pairs.for_each(|(x, &y)| *x = widen(y)),
        (false, false) => pairs.for_each(|(x, &y)| *x += widen(y)),
        (false, true) => pairs.for_each(|(x, &y)| *x = half::f16::from_f32(*x + widen(y)).to_f32()),
    }
}
