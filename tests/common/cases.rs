//! The harness of suites whose tests depend on what this machine has (a CUDA device, an
//! I/O backend, tmpfs): libtest-mimic, so that a test that cannot run here is reported
//! as ignored — counted in the summary line, its reason printed — instead of passing
//! without having checked anything. Such a suite sets `harness = false` in Cargo.toml
//! and its `main` is `run(vec![case(..), ..])`.

use libtest_mimic::{Arguments, Trial};

pub struct Case {
    name: &'static str,
    body: Box<dyn FnOnce() + Send>,
    /// Why this test cannot run on this machine, if it cannot.
    why_not: Option<String>,
}

/// A test that runs everywhere.
pub fn case(name: &'static str, body: impl FnOnce() + Send + 'static) -> Case {
    Case { name, body: Box::new(body), why_not: None }
}

impl Case {
    /// Runs only where `why_not` is `None`; skipped with that reason otherwise.
    pub fn unless(mut self, why_not: Option<String>) -> Case {
        self.why_not = why_not;
        self
    }
}

/// Runs the cases as libtest would (same arguments: a filter, `--exact`, `--list` …).
pub fn run(cases: Vec<Case>) -> ! {
    let args = Arguments::from_args();
    let trials = cases
        .into_iter()
        .map(|c| match c.why_not {
            None => {
                let body = c.body;
                Trial::test(c.name, move || {
                    body();
                    Ok(())
                })
            }
            Some(why) => {
                // Straight to stderr, next to the summary that counts it.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "{}: skipped: {why}", c.name);
                // Asked to run anyway (`--ignored`): it fails and says why.
                Trial::test(c.name, move || Err(format!("cannot run on this machine: {why}").into())).with_ignored_flag(true)
            }
        })
        .collect();
    libtest_mimic::run(&args, trials).exit()
}
