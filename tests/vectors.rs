//! The committed vectors (tests/vectors/2bit.json, made by an independent numpy
//! model) reproduced bit for bit through the public API, step after step.

use gradpack::{create_2bit, dequantize_2bit, quantize_2bit, Thresholds};
use half::{bf16, f16};
use serde_json::Value;

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

#[test]
fn committed_vectors_match() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/vectors/2bit.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for (ci, case) in cases.iter().enumerate() {
        let n = case["n"].as_u64().unwrap() as usize;
        let th = Thresholds::new(case["neg_threshold"].as_f64().unwrap() as f32, case["pos_threshold"].as_f64().unwrap() as f32).unwrap();
        let dtype = case["dtype"].as_str().unwrap();
        let mut residual = vec![0f32; n];
        for (si, step) in case["steps"].as_array().unwrap().iter().enumerate() {
            let g = u64s(&step["grad_bits"]);
            let mut compr = create_2bit(n);
            match dtype {
                "float32" => {
                    let grad: Vec<f32> = g.iter().map(|&b| f32::from_bits(b as u32)).collect();
                    quantize_2bit(&grad, &mut residual, &mut compr, th).unwrap()
                }
                "float16" => {
                    let grad: Vec<f16> = g.iter().map(|&b| f16::from_bits(b as u16)).collect();
                    quantize_2bit(&grad, &mut residual, &mut compr, th).unwrap()
                }
                "bfloat16" => {
                    let grad: Vec<bf16> = g.iter().map(|&b| bf16::from_bits(b as u16)).collect();
                    quantize_2bit(&grad, &mut residual, &mut compr, th).unwrap()
                }
                other => panic!("unknown dtype {other}"),
            }
            let got: Vec<u64> = compr.iter().map(|x| x.to_bits() as u64).collect();
            assert_eq!(got, u64s(&step["compr_bits"]), "case {ci} ({dtype}, n={n}) step {si}: compr");
            let got: Vec<u64> = residual.iter().map(|x| x.to_bits() as u64).collect();
            assert_eq!(got, u64s(&step["residual_bits"]), "case {ci} ({dtype}, n={n}) step {si}: residual");
            // Dequantize gives each element's threshold by its code (docs/contract.md §1),
            // read here straight from the committed bits.
            let mut out = vec![f32::NAN; n];
            dequantize_2bit(&compr, &mut out).unwrap();
            let committed = u64s(&step["compr_bits"]);
            let want: Vec<u32> = (0..n)
                .map(|i| match (committed[3 + i / 16] as u32 >> (30 - 2 * (i % 16))) & 0b11 {
                    0b01 => th.pos().to_bits(),
                    0b10 => th.neg().to_bits(),
                    _ => 0f32.to_bits(),
                })
                .collect();
            let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
            assert_eq!(got, want, "case {ci} ({dtype}, n={n}) step {si}: dequantize");
        }
    }
}
