//! A deterministic fake backend for the tuner's tests: candidates with
//! fixed per-call times (and a fixed noise pattern), some wrong, some
//! pruned, some failing; counters record what was verified and timed.
#![allow(dead_code)]

use kivi_tuner::bucket::Bucket;
use kivi_tuner::fingerprint::{Fingerprint, Toolchain};
use kivi_tuner::tune::{Candidate, Method, Target, Workload};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;

#[derive(Clone, Debug)]
pub struct FakeCand {
    pub name: String,
    pub hash: u64,
    /// Seconds per call.
    pub time: f64,
    pub wrong: bool,
    pub prune: Option<String>,
    pub fail_timing: bool,
}

pub fn cand(name: &str, time: f64) -> FakeCand {
    FakeCand {
        name: name.into(),
        hash: kivi_spec::fnv1a64(name.as_bytes()),
        time,
        wrong: false,
        prune: None,
        fail_timing: false,
    }
}

pub struct Fake {
    pub cands: Vec<FakeCand>,
    pub device: Fingerprint,
    pub toolchain: Toolchain,
    pub method: Method,
    /// Multipliers applied to successive samples of a candidate.
    pub noise: Vec<f64>,
    pub verified: Mutex<HashMap<String, usize>>,
    pub sampled: Mutex<HashMap<String, usize>>,
    pub checked: Mutex<HashMap<String, usize>>,
}

pub fn device(name: &str) -> Fingerprint {
    let mut facts = BTreeMap::new();
    facts.insert("cores".to_string(), "2".to_string());
    Fingerprint {
        backend: "fake".into(),
        name: name.into(),
        facts,
    }
}

impl Fake {
    pub fn new(cands: Vec<FakeCand>) -> Fake {
        Fake {
            cands,
            device: device("fake device"),
            toolchain: Toolchain::current("fakec 1.0"),
            method: Method {
                warmup_s: 0.0,
                min_sample_s: 0.0,
                ..Method::default()
            },
            noise: vec![1.0, 1.01, 0.99, 1.005, 0.995],
            verified: Mutex::default(),
            sampled: Mutex::default(),
            checked: Mutex::default(),
        }
    }
    pub fn sampled(&self, name: &str) -> usize {
        self.sampled.lock().unwrap().get(name).copied().unwrap_or(0)
    }
    pub fn verified(&self, name: &str) -> usize {
        self.verified.lock().unwrap().get(name).copied().unwrap_or(0)
    }
    pub fn total_samples(&self) -> usize {
        self.sampled.lock().unwrap().values().sum()
    }
    fn get(&self, name: &str) -> &FakeCand {
        self.cands.iter().find(|c| c.name == name).expect("known candidate")
    }
}

impl Target for Fake {
    fn backend(&self) -> &'static str {
        "fake"
    }
    fn device(&self) -> Fingerprint {
        self.device.clone()
    }
    fn toolchain(&self) -> Toolchain {
        self.toolchain.clone()
    }
    fn candidates(&self, _bucket: &Bucket) -> Vec<Candidate> {
        self.cands
            .iter()
            .map(|c| Candidate {
                name: c.name.clone(),
                hash: c.hash,
                notes: vec![],
            })
            .collect()
    }
    fn check(&self, c: &Candidate, _bucket: &Bucket) -> Result<(), String> {
        *self.checked.lock().unwrap().entry(c.name.clone()).or_default() += 1;
        match &self.get(&c.name).prune {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }
    fn workload<'a>(&'a self, _bucket: &Bucket, _prep: f64) -> Result<Box<dyn Workload + 'a>, String> {
        Ok(Box::new(FakeWork {
            fake: self,
            counts: HashMap::new(),
        }))
    }
    fn method(&self) -> Method {
        self.method.clone()
    }
    fn peak_gbps(&self) -> Option<f64> {
        Some(100.0)
    }
}

struct FakeWork<'a> {
    fake: &'a Fake,
    counts: HashMap<String, usize>,
}

impl Workload for FakeWork<'_> {
    fn bytes_per_call(&self) -> u64 {
        1_000_000
    }
    fn verify(&mut self, c: &Candidate) -> Result<(), String> {
        *self.fake.verified.lock().unwrap().entry(c.name.clone()).or_default() += 1;
        if self.fake.get(&c.name).wrong {
            Err("output 3 is 0.5 but the reference says 0.25".into())
        } else {
            Ok(())
        }
    }
    fn sample(&mut self, c: &Candidate, iters: u32) -> Result<f64, String> {
        let fc = self.fake.get(&c.name);
        if fc.fail_timing {
            return Err("launch failed".into());
        }
        *self.fake.sampled.lock().unwrap().entry(c.name.clone()).or_default() += 1;
        let k = self.counts.entry(c.name.clone()).or_default();
        let m = self.fake.noise[*k % self.fake.noise.len()];
        *k += 1;
        let _ = iters;
        Ok(fc.time * m)
    }
    fn describe(&self) -> String {
        "fake clock".into()
    }
}

/// A fresh, empty directory under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kivi-tuner-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn scheme() -> kivi_spec::Scheme {
    kivi_spec::presets::kivi2()
        .with_shape(kivi_spec::Heads::Gqa { q: 8, kv: 2 }, 64)
        .unwrap()
}

pub fn bucket() -> Bucket {
    Bucket::of(1, 1024, 4)
}
