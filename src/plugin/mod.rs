//! `kubectl podvolume`: progress of a whole Velero backup or restore, read from the API server.
//!
//! Layers: `summary` (pure: objects in, figures out, clock given), `source` (the Kubernetes
//! calls), `render` (text), `live` (the terminal view); this module wires them per subcommand.

pub mod cli;
mod live;
pub mod render;
pub mod source;
pub mod summary;

use std::collections::HashSet;
use std::io::IsTerminal;
use std::time::{Duration, SystemTime};

use futures::{Stream, StreamExt};
use kube::Client;
use serde_json::json;

use cli::{CancelTarget, ListArgs, Measure, Output, PluginCli, PluginCommand, ShowArgs};
use source::{CancelOutcome, Change, Feed};
use summary::{Item, Kind, Settings, Summary, Tracker, Volume};

/// Runs one command; the process exit code.
pub async fn main(cli: PluginCli) -> i32 {
    let client =
        match source::client(cli.conn.kubeconfig.as_deref(), cli.conn.context.as_deref()).await {
            Ok(c) => c,
            Err(e) => return fail(&e),
        };
    let ns = cli.conn.namespace;
    let result = match cli.command {
        PluginCommand::Backups(a) => list(&client, Kind::Backup, &ns, a).await,
        PluginCommand::Restores(a) => list(&client, Kind::Restore, &ns, a).await,
        PluginCommand::Backup(a) => show(&client, Kind::Backup, &ns, a).await,
        PluginCommand::Restore(a) => show(&client, Kind::Restore, &ns, a).await,
        PluginCommand::Cancel { target } => match target {
            CancelTarget::Backup { name } => cancel(&client, Kind::Backup, &ns, &name).await,
            CancelTarget::Restore { name } => cancel(&client, Kind::Restore, &ns, &name).await,
        },
    };
    match result {
        Ok(code) => code,
        Err(e) => fail(&e),
    }
}

fn fail(message: &str) -> i32 {
    eprintln!("error: {message}");
    1
}

fn settings(m: &Measure) -> Settings {
    Settings {
        window: m.window,
        stall_after: m.stalled_after,
    }
}

/// What one command watches, and what it has seen.
pub struct View {
    pub kind: Kind,
    pub namespace: String,
    /// One Velero backup/restore, or all of them.
    pub name: Option<String>,
    pub selector: String,
    pub settings: Settings,
    pub refresh: Duration,
    pub tracker: Tracker,
    /// Per feed, the uids a re-list under way has shown.
    relisted: std::collections::HashMap<Feed, HashSet<String>>,
    /// The feeds the API server serves (data movement: Velero 1.12+), found by `load`.
    feeds: Vec<Feed>,
    pub last_error: Option<String>,
}

impl View {
    fn new(
        kind: Kind,
        namespace: &str,
        name: Option<&str>,
        s: Settings,
        refresh: Duration,
    ) -> View {
        View {
            kind,
            namespace: namespace.to_string(),
            name: name.map(str::to_string),
            selector: source::selector(kind, name),
            settings: s,
            refresh,
            tracker: Tracker::new(kind, s),
            relisted: Default::default(),
            feeds: Feed::ALL.to_vec(),
            last_error: None,
        }
    }

    /// Applies a watch change observed at `at`; whether anything shown changed.
    fn apply(&mut self, change: Change, at: SystemTime) -> bool {
        match change {
            Change::Seen(o) => {
                self.last_error = None;
                let Some(v) = Volume::from_object(self.kind, &o) else {
                    return false;
                };
                let feed = if v.moved {
                    Feed::DataMovement
                } else {
                    Feed::PodVolumes
                };
                if let Some(seen) = self.relisted.get_mut(&feed) {
                    seen.insert(v.uid.clone());
                }
                self.tracker.observe(v, at)
            }
            Change::Deleted(o) => {
                Volume::from_object(self.kind, &o).is_some_and(|v| self.tracker.remove(&v.uid))
            }
            Change::RelistStart(feed) => {
                self.relisted.insert(feed, HashSet::new());
                false
            }
            Change::RelistDone(feed) => {
                self.last_error = None;
                match self.relisted.remove(&feed) {
                    Some(seen) => self.tracker.retain(feed == Feed::DataMovement, &seen),
                    None => false,
                }
            }
            Change::Error(e) => {
                self.last_error = Some(e);
                false
            }
        }
    }

    fn summary(&self, now: SystemTime) -> Option<Summary> {
        self.tracker
            .summary(self.name.as_deref().unwrap_or(""), now)
    }

    fn items(&self, now: SystemTime) -> Vec<Item> {
        self.tracker.items(self.name.as_deref().unwrap_or(""), now)
    }

    fn finished(&self) -> bool {
        self.summary(SystemTime::now()).is_some_and(|s| s.finished)
    }

    /// The current objects, read once (also how a command fails fast on missing access).
    /// Data movement objects are read where the API server serves them (Velero 1.12+).
    async fn load(&mut self, client: &Client) -> Result<(), String> {
        let mut feeds = Vec::new();
        for feed in Feed::ALL {
            let api = source::api(client, self.kind, feed, &self.namespace);
            let objects = match source::list(&api, self.kind, feed, &self.selector).await {
                Ok(o) => o,
                Err(e) if feed == Feed::DataMovement => match source::data_movement_skipped(&e) {
                    Some(warning) => {
                        if let Some(w) = warning {
                            eprintln!("{w}");
                        }
                        continue;
                    }
                    None => return Err(e),
                },
                Err(e) => return Err(e),
            };
            feeds.push(feed);
            let now = SystemTime::now();
            for o in objects {
                self.apply(Change::Seen(o), now);
            }
        }
        self.feeds = feeds;
        Ok(())
    }

    fn changes(&self, client: &Client) -> impl Stream<Item = Change> + Send + use<> {
        let watches = self.feeds.iter().map(|feed| {
            source::watch(
                source::api(client, self.kind, *feed, &self.namespace),
                *feed,
                &self.selector,
            )
            .boxed()
        });
        futures::stream::select_all(watches)
    }

    fn not_found(&self) -> String {
        format!(
            "no {}s or {}s labelled {} in namespace {} (a {} without pod volumes or moved snapshots has none; check the name and -n)",
            self.kind.resource(),
            Feed::DataMovement.resource(self.kind),
            self.selector,
            self.namespace,
            self.kind.as_str()
        )
    }

    fn document(&self, s: &Summary, now: SystemTime) -> serde_json::Value {
        json!({"namespace": self.namespace, "summary": s, "items": self.items(now)})
    }
}

/// `backups` / `restores`.
async fn list(client: &Client, kind: Kind, ns: &str, a: ListArgs) -> Result<i32, String> {
    let mut view = View::new(kind, ns, None, settings(&a.measure), Duration::from_secs(1));
    view.load(client).await?;
    let now = SystemTime::now();
    let all = |v: &View, now| -> Vec<Summary> {
        v.tracker
            .groups()
            .iter()
            .filter_map(|g| v.tracker.summary(g, now))
            .collect()
    };
    let summaries = all(&view, now);
    match a.output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&json!({"namespace": ns, "items": summaries}))
                .unwrap_or_default()
        ),
        Output::Table if summaries.is_empty() => {
            println!(
                "no {}s with a label {} in namespace {ns}",
                kind.resource(),
                kind.group_label()
            )
        }
        Output::Table => print!("{}", render::list_table(&summaries, now)),
    }
    if !a.watch {
        return Ok(0);
    }
    // One line per backup whose figures changed, as `kubectl get -w` does.
    let mut printed: std::collections::HashMap<String, String> = summaries
        .iter()
        .map(|s| (s.name.clone(), line_of(s, a.output, &view)))
        .collect();
    let mut changes = std::pin::pin!(view.changes(client));
    while let Some(c) = changes.next().await {
        if let Change::Error(e) = &c {
            eprintln!("watch: {e} (retrying)");
        }
        if !view.apply(c, SystemTime::now()) {
            continue;
        }
        for s in all(&view, SystemTime::now()) {
            let line = line_of(&s, a.output, &view);
            if printed.get(&s.name) != Some(&line) {
                println!("{}", stamped(&line, a.output));
                printed.insert(s.name.clone(), line);
            }
        }
    }
    Ok(0)
}

fn line_of(s: &Summary, output: Output, view: &View) -> String {
    match output {
        Output::Json => serde_json::to_string(s).unwrap_or_default(),
        Output::Table => render::watch_line(s, &view.settings),
    }
}

fn stamped(line: &str, output: Output) -> String {
    match output {
        Output::Json => line.to_string(),
        Output::Table => format!(
            "{}  {line}",
            humantime::format_rfc3339_seconds(SystemTime::now())
        ),
    }
}

/// `backup NAME` / `restore NAME`.
async fn show(client: &Client, kind: Kind, ns: &str, a: ShowArgs) -> Result<i32, String> {
    let mut view = View::new(kind, ns, Some(&a.name), settings(&a.measure), a.refresh);
    view.load(client).await?;
    let terminal = std::io::stdout().is_terminal();
    if a.watch {
        return watch_lines(client, view, a.output).await;
    }
    if a.once || !terminal || a.output == Output::Json {
        let now = SystemTime::now();
        let Some(s) = view.summary(now) else {
            return Err(view.not_found());
        };
        match a.output {
            Output::Json => println!(
                "{}",
                serde_json::to_string_pretty(&view.document(&s, now)).unwrap_or_default()
            ),
            Output::Table => print!(
                "{}",
                render::table(&s, &view.items(now), ns, view.settings.window, now)
            ),
        }
        return Ok(0);
    }
    let changes = view.changes(client);
    live::run(&mut view, changes)
        .await
        .map_err(|e| format!("terminal: {e}"))?;
    // What the view showed last stays on the screen after the alternate screen is gone.
    let now = SystemTime::now();
    if let Some(s) = view.summary(now) {
        print!(
            "{}",
            render::table(&s, &view.items(now), ns, view.settings.window, now)
        );
    }
    Ok(0)
}

/// `--watch`: a line (or a JSON object) per change, until every volume is finished.
async fn watch_lines(client: &Client, mut view: View, output: Output) -> Result<i32, String> {
    let mut last = String::new();
    let mut emit = |view: &View| -> bool {
        let now = SystemTime::now();
        let Some(s) = view.summary(now) else {
            return false;
        };
        let line = match output {
            Output::Json => serde_json::to_string(&view.document(&s, now)).unwrap_or_default(),
            Output::Table => render::watch_line(&s, &view.settings),
        };
        // JSON carries the stall's length; compare what changes on events only.
        let key = match output {
            Output::Json => {
                let mut d = view.document(&s, now);
                d["summary"]["stalledSeconds"] = json!(s.stalled_seconds.is_some());
                d.to_string()
            }
            Output::Table => line.clone(),
        };
        if key != last {
            println!("{}", stamped(&line, output));
            last = key;
        }
        s.finished
    };
    if emit(&view) {
        return Ok(0);
    }
    let mut changes = std::pin::pin!(view.changes(client));
    // Stalls are noticed by time, not by events.
    let mut tick = tokio::time::interval(view.refresh);
    loop {
        tokio::select! {
            c = changes.next() => {
                let Some(c) = c else { return Ok(0) };
                if let Change::Error(e) = &c {
                    eprintln!("watch: {e} (retrying)");
                }
                view.apply(c, SystemTime::now());
            }
            _ = tick.tick() => {}
        }
        if emit(&view) {
            return Ok(0);
        }
    }
}

/// `cancel backup NAME` / `cancel restore NAME`.
async fn cancel(client: &Client, kind: Kind, ns: &str, name: &str) -> Result<i32, String> {
    let selector = source::selector(kind, Some(name));
    let mut volumes: Vec<(Feed, Volume)> = Vec::new();
    for feed in Feed::ALL {
        let api = source::api(client, kind, feed, ns);
        match source::list(&api, kind, feed, &selector).await {
            Ok(objects) => volumes.extend(
                objects
                    .iter()
                    .filter_map(|o| Volume::from_object(kind, o))
                    .map(|v| (feed, v)),
            ),
            Err(e) if feed == Feed::DataMovement => match source::data_movement_skipped(&e) {
                Some(warning) => {
                    if let Some(w) = warning {
                        eprintln!("{w}");
                    }
                }
                None => return Err(e),
            },
            Err(e) => return Err(e),
        }
    }
    if volumes.is_empty() {
        let view = View::new(kind, ns, Some(name), settings_default(), Duration::ZERO);
        return Err(view.not_found());
    }
    volumes.sort_by(|a, b| (a.0 as u8, &a.1.name).cmp(&(b.0 as u8, &b.1.name)));
    let (mut asked, mut already, mut finished, mut failed) = (0, 0, 0, 0);
    for (feed, v) in &volumes {
        let resource = feed.resource(kind);
        let what = format!("{resource}/{}", v.name);
        let api = source::api(client, kind, *feed, ns);
        match source::cancel(&api, resource, v).await {
            Ok(CancelOutcome::Requested) => {
                asked += 1;
                println!("{what}: cancel requested (was {})", v.phase_label());
            }
            Ok(CancelOutcome::AlreadyRequested) => {
                already += 1;
                println!("{what}: cancel already requested ({})", v.phase_label());
            }
            Ok(CancelOutcome::Finished) => {
                finished += 1;
                println!("{what}: already {}, nothing to stop", v.phase_label());
            }
            Err(e) => {
                failed += 1;
                eprintln!("{what}: {e}");
            }
        }
    }
    println!(
        "{} {name}: cancel requested on {asked}, already requested on {already}, {finished} finished{}",
        kind.as_str(),
        if failed > 0 {
            format!(", {failed} not reachable")
        } else {
            String::new()
        }
    );
    Ok(if failed > 0 { 1 } else { 0 })
}

fn settings_default() -> Settings {
    Settings {
        window: Duration::from_secs(60),
        stall_after: Duration::from_secs(60),
    }
}
