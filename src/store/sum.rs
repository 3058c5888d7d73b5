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
    let round = |x: f32| if half { half::f16::from_f32(x).to_f32() } else { x };
    let chunk = |offset: usize, d: &mut [f32]| {
        let range = offset..offset + d.len();
        for (i, g) in grads.iter().enumerate() {
            let add = |x: &mut f32, y: f32| if i == 0 { *x = y } else { *x = round(*x + y) };
            match g.slice(range.clone()) {
                Grad::F32(g) => d.iter_mut().zip(g).for_each(|(x, &y)| add(x, y)),
                Grad::F16(g) => d.iter_mut().zip(g).for_each(|(x, &y)| add(x, y.to_f32())),
                Grad::Bf16(g) => d.iter_mut().zip(g).for_each(|(x, &y)| add(x, y.to_f32())),
            }
        }
    };
    par::chunks(dst, chunk);
}

