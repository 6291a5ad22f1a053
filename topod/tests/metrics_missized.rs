//! topod's metrics and mis-sized jobs, with real programs on real cgroups: a spinner with more
//! threads than CPUs is flagged busy, one thread on two CPUs is flagged idle, two threads on two
//! CPUs are not flagged; a scrape of the running topod parses with Prometheus's own Python
//! parser (`prometheus_client`, Debian's python3-prometheus-client) and has the per-job series.

mod common;

use serde_json::Value;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use topo_client::Client;
use topo_core::proto::Op;

/// Not a test: the spinner the jobs run (this test binary again, with `TOPO_SPIN` threads that
/// spin until killed). Without `TOPO_SPIN` it returns at once.
#[test]
fn spin_helper() {
    let Some(n) = std::env::var("TOPO_SPIN").ok().and_then(|n| n.parse::<usize>().ok()) else {
        return;
    };
    for _ in 1..n {
        std::thread::spawn(spin);
    }
    spin();
}

fn spin() {
    let mut x = 0u64;
    loop {
        x = std::hint::black_box(x.wrapping_add(1));
    }
}

/// Starts `threads` spinning threads in job `job`, given `request`, through topo-exec.
fn spinner(socket: &Path, job: &str, request: &str, threads: usize) -> Child {
    Command::new(env!("CARGO_BIN_EXE_topo-exec"))
        .args(["--socket", socket.to_str().unwrap(), "--job", job, "--request", request, "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "spin_helper", "--nocapture", "--test-threads", "1", "-q"])
        .env("TOPO_SPIN", threads.to_string())
        .stdout(Stdio::null())
        .spawn()
        .expect("topo-exec starts")
}

fn jobs(socket: &Path) -> Vec<Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_topoctl"))
        .args(["jobs", "--json", "--socket", socket.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn job<'a>(jobs: &'a [Value], id: &str) -> Option<&'a Value> {
    jobs.iter().find(|j| j["job"] == id)
}

/// Waits until `job` is flagged (its `missized`) or `within` passes.
fn flag_of(socket: &Path, id: &str, within: Duration) -> Option<Value> {
    let start = Instant::now();
    while start.elapsed() < within {
        if let Some(m) = job(&jobs(socket), id).map(|j| j["missized"].clone()) {
            if !m.is_null() {
                return Some(m);
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    None
}

fn release(socket: &Path, id: &str, mut child: Child) {
    Client::connect(socket).unwrap().call(Op::Release { job: id.into() }).unwrap();
    let _ = child.kill();
    let _ = child.wait();
}

/// One scrape over HTTP.
fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.0 200") && head.contains("version=0.0.4"), "{head}");
    body.to_string()
}

/// The scrape through prometheus_client's parser: every sample as [name, labels, value].
fn parse(text: &str) -> Vec<(String, serde_json::Map<String, Value>, f64)> {
    let script = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        out.append([s.name, s.labels, s.value])
print(json.dumps(out))
"#;
    // Debian's python3, where Debian's python3-prometheus-client is (a pyenv in PATH has not).
    let python =
        if Path::new("/usr/bin/python3").exists() { "/usr/bin/python3" } else { "python3" };
    let mut py = Command::new(python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    py.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = py.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client's parser refused the scrape (is python3-prometheus-client installed? tests/install-deps.sh installs it): {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let samples: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    samples
        .into_iter()
        .map(|s| {
            (
                s[0].as_str().unwrap().to_string(),
                s[1].as_object().unwrap().clone(),
                s[2].as_f64().unwrap(),
            )
        })
        .collect()
}

fn value(samples: &[(String, serde_json::Map<String, Value>, f64)], name: &str, job: &str) -> f64 {
    samples
        .iter()
        .find(|(n, l, _)| n == name && l.get("job").and_then(Value::as_str) == Some(job))
        .unwrap_or_else(|| panic!("no {name} for job {job}"))
        .2
}

#[test]
fn mis_sized_spinners_are_flagged_a_well_sized_one_is_not_and_the_scrape_parses() {
    let dir = common::open_dir();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let textfile = dir.path().join("topod.prom");
    let extra = format!(
        "metrics_listen = \"127.0.0.1:{port}\"\nmetrics_textfile = \"{}\"\nmetrics_interval_s = 1\nmissized_settle_s = 2\nmissized_idle_fraction = 0.6\n",
        textfile.display()
    );
    let Some((d, cgroups, _subtree, _cleanup, _config)) =
        common::real_daemon(dir.path(), "topo-metrics-test", &extra)
    else {
        return;
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        common::skip("the idle and well-sized jobs need 2 CPUs");
        return;
    }
    let socket = d.socket.clone();
    let within = Duration::from_secs(30);

    // 4 threads on 1 CPU: busy.
    let busy = spinner(&socket, "m-busy", "affinity[core*1]", 4);
    let m = flag_of(&socket, "m-busy", within).expect("the 4-thread spinner on 1 CPU is flagged");
    assert_eq!(m["kind"], "busy", "{m}");
    let reason = m["reason"].as_str().unwrap();
    eprintln!("m-busy: {reason}");
    assert!(reason.contains("threads runnable") && reason.contains("1 CPU given"), "{reason}");
    // topoctl jobs shows it in its table too.
    let table = Command::new(env!("CARGO_BIN_EXE_topoctl"))
        .args(["jobs", "--socket", socket.to_str().unwrap()])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout).to_string();
    assert!(table.contains("mis-sized (busy): busy:"), "{table}");
    release(&socket, "m-busy", busy);

    // 1 thread on 2 CPUs: idle.
    let idle = spinner(&socket, "m-idle", "affinity[core*2]", 1);
    let m = flag_of(&socket, "m-idle", within).expect("the 1-thread spinner on 2 CPUs is flagged");
    assert_eq!(m["kind"], "idle", "{m}");
    eprintln!("m-idle: {}", m["reason"]);
    release(&socket, "m-idle", idle);

    // 2 threads on 2 CPUs: well sized, never flagged; scraped meanwhile.
    let fine = spinner(&socket, "m-fine", "affinity[core*2]", 2);
    assert_eq!(flag_of(&socket, "m-fine", Duration::from_secs(9)), None, "2 threads on 2 CPUs");
    let started = Instant::now();
    let text = scrape(port);
    let took = started.elapsed();
    let samples = parse(&text);
    eprintln!(
        "scrape: {} bytes, {} samples, {} ms over loopback",
        text.len(),
        samples.len(),
        took.as_millis()
    );
    assert_eq!(value(&samples, "topod_job_cpus", "m-fine"), 2.0);
    let runnable = value(&samples, "topod_job_threads_runnable", "m-fine");
    assert!((1.0..=3.0).contains(&runnable), "runnable {runnable}");
    assert!(value(&samples, "topod_job_threads", "m-fine") >= 2.0);
    // prometheus_client names a counter's sample with its _total.
    let used = value(&samples, "topod_job_cpu_usage_seconds_total", "m-fine");
    assert!(used > 1.0 && used < 2.0 * 60.0, "cpu seconds {used}");
    // v2: the job cgroup's PSI, where the kernel keeps it (Debian's needs psi=1; the v2 guest
    // boots with it).
    if cgroups.kind() == "v2" && Path::new("/proc/pressure/cpu").exists() {
        value(&samples, "topod_job_cpu_pressure_some_seconds_total", "m-fine");
        value(&samples, "topod_job_memory_pressure_some_seconds_total", "m-fine");
    }
    let get = |name: &str, label: Option<(&str, &str)>| {
        samples
            .iter()
            .find(|(n, l, _)| {
                n == name && label.is_none_or(|(k, v)| l.get(k).and_then(Value::as_str) == Some(v))
            })
            .unwrap_or_else(|| panic!("no {name} {label:?}"))
            .2
    };
    assert_eq!(get("topod_cpus", Some(("state", "held"))), 2.0);
    assert!(get("topod_allocations_total", None) >= 3.0);
    assert!(get("topod_releases_with_leftovers_total", None) >= 2.0);
    assert!(get("topod_leftover_processes_killed_total", None) >= 2.0);
    assert_eq!(get("topod_jobs_flagged_total", Some(("kind", "busy"))), 1.0);
    assert_eq!(get("topod_jobs_flagged_total", Some(("kind", "idle"))), 1.0);
    assert!(get("topod_request_duration_seconds_count", Some(("op", "allocate"))) >= 3.0);
    let sampling = get("topod_sample_duration_seconds", None);
    eprintln!("one sampling round: {:.3} ms", sampling * 1e3);
    // The textfile holds the same families, whole.
    let file = std::fs::read_to_string(&textfile).expect("the textfile is written");
    let from_file = parse(&file);
    assert!(from_file.iter().any(|(n, l, _)| n == "topod_job_cpus" && l["job"] == "m-fine"));
    release(&socket, "m-fine", fine);

    // The log said each flag once, with its event.
    let log = std::fs::read_to_string(dir.path().join("topod.log")).unwrap();
    for (id, kind) in [("m-busy", "busy"), ("m-idle", "idle")] {
        let lines: Vec<&str> =
            log.lines().filter(|l| l.contains("event=\"flagged\"") && l.contains(id)).collect();
        assert_eq!(lines.len(), 1, "{id}: {lines:?}");
        assert!(lines[0].contains(kind), "{}", lines[0]);
    }
    assert!(!log.lines().any(|l| l.contains("event=\"flagged\"") && l.contains("m-fine")));
    for event in ["allocated", "joined", "released"] {
        assert!(log.contains(&format!("event=\"{event}\"")), "no {event} line in\n{log}");
    }
}
