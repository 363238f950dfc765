//! Where a block lives: its residencies (medium, locality, ownership), and how much a hit in each
//! tier is worth compared with one in GPU memory.

use std::fmt;
use std::str::FromStr;

/// One copy of a block: the tier (`medium`: "GPU", "CPU", "CPU_PINNED", "STORAGE", ...), where
/// that tier is (`locality`, e.g. "LOCAL") and which component owns the copy (`ownership`, e.g.
/// "kvcr", a secondary tier's). Two copies differ when any of the three differs: removing one
/// leaves the others.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Residency {
    pub medium: String,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

impl Residency {
    /// The engine's main cache (an event without a medium means it).
    pub fn gpu() -> Self {
        Residency { medium: GPU.to_owned(), locality: None, ownership: None }
    }

    /// The residency an event names; no medium is the GPU.
    pub fn of(medium: Option<&str>, locality: Option<&str>, ownership: Option<&str>) -> Self {
        let medium = match medium {
            None => GPU.to_owned(),
            Some(name) if name.eq_ignore_ascii_case(GPU) => GPU.to_owned(),
            Some(name) => name.to_owned(),
        };
        Residency { medium, locality: locality.map(str::to_owned), ownership: ownership.map(str::to_owned) }
    }
}

/// `GPU`, `CPU locality=LOCAL`, `CPU ownership=kvcr` (the captures' notation).
impl fmt::Display for Residency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.medium)?;
        if let Some(locality) = &self.locality {
            write!(f, " locality={locality}")?;
        }
        if let Some(ownership) = &self.ownership {
            write!(f, " ownership={ownership}")?;
        }
        Ok(())
    }
}

const GPU: &str = "GPU";

/// Per medium, the share of a GPU hit's saving a hit in that tier earns: a block in host memory
/// is loaded back instead of recomputed, which costs transfer time, not prefill.
///
/// Written `GPU=1,CPU=0.95,DISK=0.25` (the medium names the engines send, case-insensitive;
/// `*` sets the weight of media not listed). A tier's weight is one minus the cost of loading a
/// block back over the cost of recomputing it. Host memory: a token's KV (~128 KiB for an 8B
/// model) over PCIe at ~25 GB/s loads back at ~190,000 tokens/s, against a prefill of ~8,000
/// tokens/s (the engine reference in ../shared/bench/SCENARIOS.md), so a host hit saves ~96% of
/// the prefill: 0.95. The peers' 0.75 (Dynamo's router) undervalued it: on S4 with a host tier
/// it cost 3.7% TTFT mean against counting every tier as the GPU, 0.95 is level with it
/// (docs/BENCHMARKS.md). Disk and remote storage stay at the peers' 0.25 (no measurement here).
#[derive(Clone, Debug, PartialEq)]
pub struct TierWeights {
    /// (medium, weight), upper-cased names.
    weights: Vec<(String, f64)>,
    other: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        "GPU=1,CPU=0.95,CPU_PINNED=0.95,STORAGE=0.25,DISK=0.25,*=0.25".parse().expect("valid defaults")
    }
}

impl TierWeights {
    /// Every tier counts as the GPU (weight 1): what kvgate did before tiers were weighed.
    pub fn flat() -> Self {
        TierWeights { weights: Vec::new(), other: 1.0 }
    }

    /// The weight of a hit in `medium`.
    pub fn weight(&self, medium: &str) -> f64 {
        self.weights
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(medium))
            .map_or(self.other, |&(_, weight)| weight)
    }
}

impl FromStr for TierWeights {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let mut weights: Vec<(String, f64)> = Vec::new();
        let mut other = None;
        for part in text.split(',').map(str::trim).filter(|part| !part.is_empty()) {
            let (name, value) =
                part.split_once('=').ok_or_else(|| format!("`{part}` is not MEDIUM=WEIGHT"))?;
            let (name, value) = (name.trim(), value.trim());
            let weight: f64 = value.parse().map_err(|_| format!("`{value}` (for {name}) is not a number"))?;
            if !(0.0..=1.0).contains(&weight) {
                return Err(format!("the weight of {name} must be within 0..=1, got {value}"));
            }
            if name.is_empty() {
                return Err(format!("`{part}` has no medium name"));
            }
            if name == "*" {
                other = Some(weight);
                continue;
            }
            let name = name.to_ascii_uppercase();
            if weights.iter().any(|(known, _)| *known == name) {
                return Err(format!("{name} is given twice"));
            }
            weights.push((name, weight));
        }
        if weights.is_empty() && other.is_none() {
            return Err("no MEDIUM=WEIGHT pair".to_owned());
        }
        // GPU is the reference: a hit there saves the whole prefill unless said otherwise.
        if !weights.iter().any(|(name, _)| name == GPU) {
            weights.insert(0, (GPU.to_owned(), 1.0));
        }
        Ok(TierWeights { weights, other: other.unwrap_or(0.25) })
    }
}

impl fmt::Display for TierWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, weight) in &self.weights {
            write!(f, "{name}={weight},")?;
        }
        write!(f, "*={}", self.other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_parse_with_defaults_and_errors() {
        let weights: TierWeights = "cpu=0.5, DISK=0.1".parse().unwrap();
        assert_eq!((weights.weight("GPU"), weights.weight("CPU"), weights.weight("disk")), (1.0, 0.5, 0.1));
        assert_eq!(weights.weight("STORAGE"), 0.25, "an unlisted medium gets the `*` weight");
        assert_eq!("GPU=1,*=1".parse::<TierWeights>().unwrap().weight("CPU"), 1.0);
        let defaults = TierWeights::default();
        assert_eq!((defaults.weight("CPU_PINNED"), defaults.weight("STORAGE")), (0.95, 0.25));
        assert_eq!(defaults.to_string().parse::<TierWeights>().unwrap(), defaults);
        for (bad, message) in [
            ("CPU", "`CPU` is not MEDIUM=WEIGHT"),
            ("CPU=fast", "`fast` (for CPU) is not a number"),
            ("CPU=1.5", "the weight of CPU must be within 0..=1, got 1.5"),
            ("CPU=NaN", "the weight of CPU must be within 0..=1, got NaN"),
            ("CPU=1,cpu=0", "CPU is given twice"),
            ("", "no MEDIUM=WEIGHT pair"),
            ("=1", "`=1` has no medium name"),
        ] {
            assert_eq!(bad.parse::<TierWeights>().unwrap_err(), message, "{bad}");
        }
    }

    #[test]
    fn residencies_read_as_the_captures_write_them() {
        assert_eq!(Residency::of(None, None, None), Residency::gpu());
        assert_eq!(Residency::of(Some("gpu"), None, None).to_string(), "GPU");
        assert_eq!(Residency::of(Some("STORAGE"), Some("LOCAL"), None).to_string(), "STORAGE locality=LOCAL");
        assert_eq!(Residency::of(Some("CPU"), None, Some("kvcr")).to_string(), "CPU ownership=kvcr");
    }
}
