//! Shape-aware matrix-multiply and attention efficiency.
//!
//! A GPU runs a matrix multiply as output tiles spread over its compute units (SMs, CUs) in
//! waves; a tile is computed whole even where the matrix covers only part of it, and the last
//! wave leaves units idle when the tiles do not fill it (tile and wave quantisation, NVIDIA's
//! "Matrix Multiplication Background" guide). Each tile also pays a fixed prologue and epilogue
//! besides its k-loop, which short reduction dimensions cannot hide. So a GEMM's rate is the
//! device's best rate (the calibrated matmul efficiency) times
//!
//! ```text
//! useful tile area / computed tile area × k / (k + K_OVERHEAD)
//! ```
//!
//! Fused attention (FlashAttention) loses rate on small heads and short sequences in the same
//! way: `d / (d + D_OVERHEAD) × s / (s + S_OVERHEAD)`, from FlashAttention-2's published kernel
//! benchmarks (Dao 2023, arXiv 2307.08691, figures 4-6: head size 64 reaches about 0.8 of head
//! size 128's rate, 512-token sequences about 0.6 of 16K ones).

use medley_spec::{DeviceSpec, ModelSpec, Vendor};

/// k-loop length whose fixed cost a tile pays once: about two 64-deep k-tiles of prologue
/// (pipeline fill) and epilogue (accumulator write-back).
const K_OVERHEAD: f64 = 128.0;

/// A half-size tile's rate against the large one's: less reuse of each loaded operand.
const HALF_TILE_RATE: f64 = 0.9;

/// Head size at which fused attention reaches half its rate per FLOP.
const D_OVERHEAD: f64 = 32.0;

/// Key length at which fused attention reaches half its rate per FLOP.
const S_OVERHEAD: f64 = 256.0;

/// `batch` independent multiplies of an (m × k) by a (k × n) matrix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub batch: f64,
    pub m: f64,
    pub n: f64,
    pub k: f64,
}

impl Gemm {
    fn new(m: f64, k: f64, n: f64) -> Gemm {
        Gemm { batch: 1.0, m, n, k }
    }

    pub fn flops(&self) -> f64 {
        2.0 * self.batch * self.m * self.n * self.k
    }

    /// The backward's multiply for the input gradient: dX (m × k) = dY (m × n) · Wᵀ.
    pub fn input_gradient(self) -> Gemm {
        Gemm { n: self.k, k: self.n, ..self }
    }

    /// The backward's multiply for the weight gradient: dW (k × n) = Xᵀ (k × m) · dY (m × n).
    pub fn weight_gradient(self) -> Gemm {
        Gemm { m: self.k, k: self.m, ..self }
    }
}

/// The forward multiplies of one layer over `tokens` tokens on one of `tp` tensor-parallel ranks
/// (sequence parallelism gathers every token before the column-parallel multiplies): Q, K and V
/// as one, the output projection, the MLP's up (and gate, as one) and down projections per
/// expert a token visits, and a mixture's router.
pub fn layer_gemms(model: &ModelSpec, tokens: f64, tp: u32) -> Vec<Gemm> {
    let (h, t) = (f64::from(model.hidden()), f64::from(tp));
    let (q, kv) = (model.q_width() as f64, model.kv_width() as f64);
    let up_matrices = (model.mlp().n_matrices() - 1) as f64;
    let mlp = |rows: f64, width: f64, batch: f64| {
        [Gemm { batch, ..Gemm::new(rows, h, up_matrices * width / t) }, Gemm { batch, ..Gemm::new(rows, width / t, h) }]
    };
    let mut gemms = vec![Gemm::new(tokens, h, (q + 2.0 * kv) / t), Gemm::new(tokens, q / t, h)];
    match model.experts() {
        Some(experts) => {
            let n_experts = f64::from(experts.n_experts);
            let shared = f64::from(experts.shared_ffn_hidden);
            let routed_width = (model.active_ffn_width() as f64 - shared) / f64::from(experts.top_k);
            let rows_per_expert = tokens * f64::from(experts.top_k) / n_experts;
            gemms.push(Gemm::new(tokens, h, n_experts));
            gemms.extend(mlp(rows_per_expert, routed_width, n_experts));
            if shared > 0.0 {
                gemms.extend(mlp(tokens, shared, 1.0));
            }
        }
        None => gemms.extend(mlp(tokens, f64::from(model.ffn_hidden()), 1.0)),
    }
    gemms
}

/// The output projection over `tokens` tokens on one of `tp` ranks (vocabulary-parallel).
pub fn head_gemm(model: &ModelSpec, tokens: f64, tp: u32) -> Gemm {
    Gemm::new(tokens, f64::from(model.hidden()), f64::from(model.vocab()) / f64::from(tp))
}

/// The batched multiplies of an unfused attention core: QKᵀ and score × V over all s² pairs for
/// each of `micro_batch` sequences' heads on one of `tp` ranks.
pub fn unfused_attention_gemms(model: &ModelSpec, seq_len: u32, micro_batch: u32, tp: u32) -> [Gemm; 2] {
    let (s, d) = (f64::from(seq_len), f64::from(model.head_dim()));
    let batch = f64::from(micro_batch) * f64::from(model.n_heads()) / f64::from(tp);
    [Gemm { batch, ..Gemm::new(s, d, s) }, Gemm { batch, ..Gemm::new(s, s, d) }]
}

/// How a device type's GEMM kernels cut the work: output tiles of `tile` over `units`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmGeometry {
    pub units: u32,
    /// Rows and columns of the usual large bf16 tile; the longer side goes along the longer
    /// output dimension.
    pub tile: (u32, u32),
}

impl GemmGeometry {
    /// The catalog devices' compute units (datasheets: SMs, CUs) and usual tiles (cuBLAS's
    /// 128 × 256 on Ampere and Hopper, hipBLASLt's 256 × 256 macro tiles on CDNA); `None` for
    /// devices declared elsewhere, which are then priced without quantisation. Where one family
    /// prefixes another (`h20`, `h200`) the longest wins.
    pub fn of(device: &DeviceSpec) -> Option<GemmGeometry> {
        let name = device.name.to_ascii_lowercase();
        let catalog_units = || {
            [
                ("v100", 80),
                // Third-party spec tables (TechPowerUp-style): T4 40, A10 72, A40 84, RTX A6000
                // 84, L4 58 (7,424 CUDA cores; some tables say 60).
                ("t4", 40),
                ("a10", 72),
                ("a100", 108),
                ("a40", 84),
                ("rtx-a6000", 84),
                ("h100-sxm", 132),
                ("h100-pcie", 114),
                ("h200", 132),
                // H800 is H100 SXM5 silicon (secondary); H20's 78 SMs are from Geekbench listings.
                ("h800", 132),
                ("h20", 78),
                // B200 enables 148 SMs (Chips and Cheese); GB200's GPU is assumed the same.
                ("b200", 148),
                ("gb200", 148),
                ("l4", 58),
                ("l40s", 142),
                ("rtx-4090", 128),
                // AMD tables: MI100 120, MI210 104; MI355X 8 XCDs of 32 CUs (ROCm GPU specs).
                ("mi100", 120),
                ("mi210", 104),
                ("mi250x", 220),
                ("mi300x", 304),
                ("mi325x", 304),
                ("mi355x", 256),
            ]
            .into_iter()
            .filter(|(family, _)| name.starts_with(family))
            .max_by_key(|(family, _)| family.len())
            .map(|(_, units)| units)
        };
        let units = device.compute_units.or_else(catalog_units)?;
        let tile = match device.vendor {
            Vendor::Nvidia => (128, 256),
            Vendor::Amd => (256, 256),
        };
        Some(GemmGeometry { units, tile })
    }

    /// The better of the large tile and half of it (at [`HALF_TILE_RATE`]), as GEMM libraries
    /// pick smaller tiles for matrices that would leave units idle.
    fn quantisation(&self, gemm: &Gemm) -> f64 {
        let large = self.useful_area(gemm, self.tile);
        // Half tiles cannot beat large ones that waste less than they lose.
        if large >= HALF_TILE_RATE {
            return large;
        }
        large.max(HALF_TILE_RATE * self.useful_area(gemm, (self.tile.0, self.tile.1 / 2)))
    }

    /// The fraction of the computed tile area that is `gemm`'s output with tiles of `tile`:
    /// partial tiles at the edges and idle units in the last wave both count as waste.
    fn useful_area(&self, gemm: &Gemm, tile: (u32, u32)) -> f64 {
        let (short, long) = (f64::from(tile.0.min(tile.1)), f64::from(tile.0.max(tile.1)));
        let (tile_m, tile_n) = if gemm.m >= gemm.n { (long, short) } else { (short, long) };
        let tiles = gemm.batch * (gemm.m / tile_m).ceil() * (gemm.n / tile_n).ceil();
        let units = f64::from(self.units);
        let computed = (tiles / units).ceil() * units * tile_m * tile_n;
        if computed > 0.0 { (gemm.batch * gemm.m * gemm.n / computed).min(1.0) } else { 1.0 }
    }
}

/// The fraction of its best rate a device of `geometry` reaches on `gemm` (see the module docs).
pub fn gemm_shape_factor(geometry: Option<GemmGeometry>, gemm: &Gemm) -> f64 {
    let quantisation = geometry.map_or(1.0, |geometry| geometry.quantisation(gemm));
    quantisation * gemm.k / (gemm.k + K_OVERHEAD)
}

/// The fraction of its best rate fused attention reaches with `model`'s head size over
/// `key_len` keys per query.
pub fn attention_shape_factor(model: &ModelSpec, key_len: f64) -> f64 {
    let d = f64::from(model.head_dim());
    d / (d + D_OVERHEAD) * key_len / (key_len + S_OVERHEAD)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flops::layer_forward;
    use medley_spec::{catalog_device, catalog_model};

    #[test]
    fn a_layers_gemms_do_the_layers_matmul_flops_split_over_tp() {
        for name in ["llama3-8b", "llama3-70b", "gpt3-175b", "qwen2-7b", "mixtral-8x7b"] {
            let model = catalog_model(name).unwrap();
            for tp in [1, 2, 8] {
                let tokens = 8192.0;
                let gemms: f64 = layer_gemms(&model, tokens, tp).iter().map(Gemm::flops).sum();
                let expected = layer_forward(&model, 8192, 1).matmul / f64::from(tp);
                assert!((gemms / expected - 1.0).abs() < 1e-3, "{name} tp {tp}: {gemms} vs {expected}");
            }
        }
    }

    #[test]
    fn gradients_do_the_same_work_as_the_forward() {
        let gemm = Gemm { batch: 3.0, m: 100.0, n: 200.0, k: 300.0 };
        assert_eq!(gemm.input_gradient().flops(), gemm.flops());
        assert_eq!(gemm.weight_gradient().flops(), gemm.flops());
    }

    #[test]
    fn large_aligned_gemms_run_near_the_best_rate_and_small_or_ragged_ones_below_it() {
        let h100 = GemmGeometry::of(&catalog_device("h100").unwrap());
        let big = Gemm::new(128.0 * 256.0 * 132.0 / 256.0, 16384.0, 256.0 * 8.0);
        let big_factor = gemm_shape_factor(h100, &big);
        assert!(big_factor > 0.99, "{big_factor}");
        // A short reduction pays its tile's fixed cost.
        let short_k = gemm_shape_factor(h100, &Gemm { k: K_OVERHEAD, ..big });
        assert!((short_k - 0.5).abs() < 1e-12, "{short_k}");
        // One tile more than a full wave runs a second wave almost empty; half tiles fill two
        // of three waves.
        let one_wave = Gemm::new(256.0 * 132.0, 16384.0, 128.0);
        let spilled = Gemm::new(256.0 * 133.0, 16384.0, 128.0);
        let (full, ragged) = (gemm_shape_factor(h100, &one_wave), gemm_shape_factor(h100, &spilled));
        let half_tiles = HALF_TILE_RATE * 266.0 / (3.0 * 132.0);
        assert!((ragged / full - half_tiles).abs() < 1e-9, "{ragged} vs {full}");
        // A matrix of a quarter wave of large tiles takes half tiles, and still leaves units idle.
        let small = Gemm::new(256.0 * 33.0, 16384.0, 128.0);
        let small_factor = gemm_shape_factor(h100, &small);
        assert!((small_factor / full - HALF_TILE_RATE * 0.5).abs() < 0.01, "{small_factor}");
        // Devices medley knows nothing of are priced without quantisation.
        assert_eq!(gemm_shape_factor(None, &spilled), gemm_shape_factor(None, &one_wave));
    }

    /// Issue 33: a family that prefixes another (`h20` of `h200`, `a10` of `a100`, `l4` of
    /// `l40s`) must not take its SM count.
    #[test]
    fn catalog_devices_take_their_own_compute_units() {
        let units = |name: &str| GemmGeometry::of(&catalog_device(name).unwrap()).map(|geometry| geometry.units);
        let expected = [
            ("h20", 78),
            ("h200", 132),
            ("a10", 72),
            ("a100", 108),
            ("l4", 58),
            ("l40s", 142),
            ("b200", 148),
            ("gb200", 148),
            ("t4", 40),
            ("mi100", 120),
            ("mi210", 104),
            ("mi355x", 256),
        ];
        for (name, count) in expected {
            assert_eq!(units(name), Some(count), "{name}");
        }
    }

    #[test]
    fn fused_attention_is_slower_per_flop_on_small_heads_and_short_sequences() {
        let model = catalog_model("llama3-8b").unwrap();
        let long = attention_shape_factor(&model, 16384.0);
        assert!(attention_shape_factor(&model, 512.0) < 0.7 * long);
        assert!(long < 1.0 && long > 0.7, "{long}");
    }
}
