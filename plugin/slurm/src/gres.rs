//! The GPUs Slurm gave a job, as device files: Slurm numbers a node's GPUs 0, 1, ... and says
//! which a job got in its environment (`SLURM_JOB_GPUS`, `SLURM_STEP_GPUS`: "0,1"); its
//! `gres.conf` says which device file each number is. topod then finds the PCI function behind
//! each file and places the job's CPUs near it.
//!
//! Slurm's numbering, as observed on Slurm 22.05 (`tests/slurm-gpu.sh` checks it against
//! Slurm's own core binding): the node's `Name=gpu` lines in `gres.conf` order, each line's
//! `File=` expanded in order (`/dev/nvidia[0-3]`), counted from 0; a line with a `NodeName=`
//! that does not name this node does not count. The number in a file's name is not the index
//! (`slurmd -G` lists a `/dev/gpu5` first as `Index=5`, and a job given it sees `0`).
//!
//! Not read: GPUs Slurm finds itself (`AutoDetect=nvml`, `rsmi`, ...), whose order this file
//! does not give; `Include` lines. [`gpu_files`] refuses those, saying so, and the plug-in then
//! places the job as without GPUs.

/// The device files of the node's GPUs, in Slurm's order, from `gres.conf` text; `node` is
/// Slurm's name for this node (`SLURMD_NODENAME`).
pub fn gpu_files(text: &str, node: &str) -> Result<Vec<String>, String> {
    let mut files = Vec::new();
    for (number, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |what: String| format!("gres.conf line {}: {what}", number + 1);
        let mut fields: Vec<(String, &str)> = Vec::new();
        for word in line.split_whitespace() {
            let Some((key, value)) = word.split_once('=') else {
                if word.eq_ignore_ascii_case("include") {
                    return Err(at("Include is not read by topo's plug-in".into()));
                }
                return Err(at(format!("{word:?} is not KEY=VALUE")));
            };
            fields.push((key.to_ascii_lowercase(), value));
        }
        let get = |key: &str| fields.iter().find(|(k, _)| k == key).map(|(_, v)| *v);
        if let Some(nodes) = get("nodename") {
            if !expand(nodes).map_err(at)?.iter().any(|n| n == node) {
                continue;
            }
        }
        if let Some(detect) = get("autodetect").filter(|d| !d.eq_ignore_ascii_case("off")) {
            return Err(at(format!(
                "AutoDetect={detect}: Slurm finds the GPUs itself, and their order is not in gres.conf"
            )));
        }
        if !get("name").is_some_and(|n| n.eq_ignore_ascii_case("gpu")) {
            continue;
        }
        let Some(file) = get("file") else {
            return Err(at("a GPU without File=: its device file is not known".into()));
        };
        files.extend(expand(file).map_err(at)?);
    }
    Ok(files)
}

/// The files Slurm's GPU numbers `indices` ("0,2" or "0-1", as `SLURM_JOB_GPUS` says them)
/// stand for among `files`.
pub fn pick(files: &[String], indices: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for index in expand_numbers(indices)? {
        let file = files.get(index as usize).ok_or_else(|| {
            format!("GPU {index}: gres.conf lists {} GPU(s) for this node", files.len())
        })?;
        out.push(file.clone());
    }
    Ok(out)
}

/// A Slurm host list or file list: `a,b`, `tux[0-3,7]`, `/dev/nvidia[0-1]`, in order.
fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut item = String::new();
    let mut inside = false;
    for c in list.chars() {
        match c {
            '[' if inside => return Err(format!("{list:?}: '[' inside [...]")),
            ']' if !inside => return Err(format!("{list:?}: ']' without '['")),
            '[' | ']' => inside = !inside,
            _ => {}
        }
        if c == ',' && !inside {
            out.extend(expand_one(&item)?);
            item.clear();
        } else {
            item.push(c);
        }
    }
    if inside {
        return Err(format!("{list:?}: '[' without ']'"));
    }
    out.extend(expand_one(&item)?);
    Ok(out)
}

/// One `prefix[ranges]suffix` (at most one bracket group), or a plain name.
fn expand_one(item: &str) -> Result<Vec<String>, String> {
    let Some((prefix, rest)) = item.split_once('[') else {
        if item.contains(']') || item.is_empty() {
            return Err(format!("{item:?} is not a name or a range such as gpu[0-3]"));
        }
        return Ok(vec![item.to_string()]);
    };
    let (ranges, suffix) =
        rest.split_once(']').ok_or_else(|| format!("{item:?}: '[' without ']'"))?;
    if suffix.contains('[') {
        return Err(format!("{item:?}: one [range] per name is read"));
    }
    let mut out = Vec::new();
    for part in ranges.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let width = a.len();
        let (from, to) = (number(a, item)?, number(b, item)?);
        if to < from || to - from > 65_535 {
            return Err(format!("{item:?}: range {part} is empty or too long"));
        }
        out.extend((from..=to).map(|n| format!("{prefix}{n:0width$}{suffix}")));
    }
    Ok(out)
}

fn number(text: &str, item: &str) -> Result<u64, String> {
    text.trim().parse().map_err(|_| format!("{item:?}: {text:?} is not a number"))
}

/// "0,2-3" as numbers, in order.
fn expand_numbers(list: &str) -> Result<Vec<u64>, String> {
    let mut out = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (from, to) = (number(a, list)?, number(b, list)?);
        if to < from || to - from > 65_535 {
            return Err(format!("{list:?}: range {part} is empty or too long"));
        }
        out.extend(from..=to);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nodes_gpus_are_its_gpu_lines_files_in_order() {
        let conf = "\
# a comment
NodeName=tux[0-3] Name=gpu Type=a100 File=/dev/nvidia[0-1] Cores=0-15
NodeName=tux[0-3] Name=gpu Type=a100 File=/dev/nvidia[2-3]   # the second socket's
NodeName=big01 Name=gpu File=/dev/nvidia[0-7]
Name=mps Count=100
name=GPU file=/dev/dri/card1,/dev/dri/card2
";
        assert_eq!(
            gpu_files(conf, "tux2").unwrap(),
            [
                "/dev/nvidia0",
                "/dev/nvidia1",
                "/dev/nvidia2",
                "/dev/nvidia3",
                "/dev/dri/card1",
                "/dev/dri/card2"
            ]
        );
        assert_eq!(gpu_files(conf, "big01").unwrap().len(), 10);
        assert_eq!(gpu_files(conf, "other").unwrap(), ["/dev/dri/card1", "/dev/dri/card2"]);
        let files = gpu_files(conf, "tux0").unwrap();
        assert_eq!(pick(&files, "1,3").unwrap(), ["/dev/nvidia1", "/dev/nvidia3"]);
        assert_eq!(pick(&files, "4-5").unwrap(), ["/dev/dri/card1", "/dev/dri/card2"]);
        assert!(pick(&files, "6").unwrap_err().contains("GPU 6: gres.conf lists 6 GPU(s)"));
        assert_eq!(expand("n[08-10]").unwrap(), ["n08", "n09", "n10"]);
    }

    #[test]
    fn what_does_not_say_the_files_is_refused_naming_the_line() {
        let e = gpu_files("AutoDetect=nvml\nName=gpu\n", "n").unwrap_err();
        assert!(e.starts_with("gres.conf line 1: AutoDetect=nvml"), "{e}");
        let e = gpu_files("Name=gpu Count=2\n", "n").unwrap_err();
        assert!(e.contains("line 1: a GPU without File="), "{e}");
        let e = gpu_files("\nName=gpu File=/dev/nvidia[0-\n", "n").unwrap_err();
        assert!(e.contains("line 2") && e.contains("without ']'"), "{e}");
        assert!(gpu_files("include /etc/slurm/more.conf\n", "n").unwrap_err().contains("Include"));
        assert!(pick(&["a".into()], "x").is_err());
        // Another node's AutoDetect does not matter here.
        assert!(gpu_files("NodeName=x AutoDetect=nvml\nName=gpu File=/dev/a\n", "n").is_ok());
    }
}
