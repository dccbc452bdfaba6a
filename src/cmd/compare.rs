//! `workshop compare`, `gather` and `collect`: runs side by side, the ranks of a launched run
//! gathered into one, and a class's results collected into one table.

use anyhow::{Result, bail};

use super::args::{CollectArgs, CompareArgs, GatherArgs};
use crate::bench;
use crate::course::{self, state::ResultTable};
use crate::report;

pub fn gather(a: GatherArgs) -> Result<()> {
    for path in a.json.iter() {
        crate::files::check_destination(path)?;
    }
    let g = bench::data_parallel::gather(&a.dir)?;
    println!("{}", report::bench::gathered(&g));
    if let Some(path) = &a.json {
        crate::files::write_atomic(path, serde_json::to_string_pretty(&g)?.as_bytes())?;
        println!("Wrote {}", path.display());
    }
    Ok(())
}

pub fn compare(a: CompareArgs) -> Result<()> {
    for path in [&a.markdown, &a.chart].into_iter().flatten() {
        crate::files::check_destination(path)?;
    }
    let records = a
        .records
        .iter()
        .map(|p| Ok((p.display().to_string(), bench::compare::load(p)?)))
        .collect::<Result<Vec<_>>>()?;
    let c = bench::compare::compare(&records);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&c)?);
    } else {
        println!("{}", report::compare::comparison(&c));
    }
    if let Some(path) = &a.markdown {
        crate::files::write_atomic(path, report::compare::comparison_markdown(&c).as_bytes())?;
        eprintln!("Wrote {}", path.display());
    }
    if let Some(path) = &a.chart {
        report::charts::comparison(&c, path)?;
        eprintln!("Drew {}", path.display());
    }
    Ok(())
}

pub fn collect(a: CollectArgs) -> Result<()> {
    for path in [&a.csv, &a.chart].into_iter().flatten() {
        crate::files::check_destination(path)?;
    }
    let (class, skipped) = course::collect::collect(&a.dir)?;
    let rows: Vec<Vec<String>> = class.iter().map(course::collect::cells).collect();
    let table = ResultTable {
        header: course::collect::HEADER.map(String::from).to_vec(),
        rows,
    };
    println!(
        "{} students under {}\n{}",
        class.len(),
        a.dir.display(),
        crate::report::course::table(&table)
    );
    for (f, why) in &skipped {
        println!(
            "skipped {}: {why}",
            crate::units::printable(&f.display().to_string())
        );
    }
    if class.is_empty() {
        bail!(
            "no workshop results under `{}` (looked for results.json in every folder)",
            a.dir.display()
        );
    }
    if let Some(path) = &a.csv {
        crate::files::write_atomic(path, course::collect::csv(&class).as_bytes())?;
        println!("Wrote {}", path.display());
    }
    if let Some(path) = &a.chart {
        // Students who share a name keep bars of their own, told apart by their folders.
        let group = |s: &course::collect::Student| {
            let twins = class.iter().filter(|o| o.name == s.name).count();
            match (
                twins,
                s.path.parent().and_then(|p| p.strip_prefix(&a.dir).ok()),
            ) {
                (2.., Some(folder)) if !folder.as_os_str().is_empty() => {
                    format!("{} ({})", s.name, folder.display())
                }
                _ => s.name.clone(),
            }
        };
        let bars: Vec<report::charts::Bar> = class
            .iter()
            .filter_map(|s| {
                Some(report::charts::Bar {
                    group: group(s),
                    series: s.device.clone(),
                    value: s.baseline_throughput?,
                    range: None,
                })
            })
            .collect();
        if bars.is_empty() {
            bail!("no student has a baseline throughput (01-baseline) to draw yet");
        }
        report::charts::bars(
            path,
            "Baseline throughput by student and device",
            "images/s",
            &bars,
        )?;
        println!("Drew {}", path.display());
    }
    Ok(())
}
