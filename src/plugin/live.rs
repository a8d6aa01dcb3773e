//! The live view of one backup/restore on a terminal: the alternate screen, redrawn at a steady
//! rate from what the watch has brought, until every volume is finished or the user quits
//! (q, Esc, Ctrl-C, SIGINT, SIGTERM). The terminal is given back as it was on every way out,
//! a panic included (the guard's `Drop`).

use std::io::Write;
use std::time::SystemTime;

use crossterm::event::{Event, EventStream, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use crossterm::{cursor, execute, queue, style, terminal};
use futures::{Stream, StreamExt};
use tokio::signal::unix::{SignalKind, signal};

use super::View;
use super::render;
use super::source::Change;

/// Raw mode, alternate screen, hidden cursor while alive.
struct Screen;

impl Screen {
    fn enter() -> std::io::Result<Screen> {
        terminal::enable_raw_mode()?;
        let screen = Screen;
        execute!(
            std::io::stdout(),
            terminal::EnterAlternateScreen,
            cursor::Hide
        )?;
        Ok(screen)
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = execute!(
            std::io::stdout(),
            style::ResetColor,
            cursor::Show,
            terminal::LeaveAlternateScreen
        );
        let _ = terminal::disable_raw_mode();
    }
}

/// How the view ended.
pub enum End {
    Finished,
    Quit,
}

pub async fn run(
    view: &mut View,
    changes: impl Stream<Item = Change> + Send,
) -> std::io::Result<End> {
    let screen = Screen::enter()?;
    let mut keys = EventStream::new();
    let mut tick = tokio::time::interval(view.refresh);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut changes = std::pin::pin!(changes);
    let end = loop {
        tokio::select! {
            change = changes.next() => match change {
                Some(c) => { view.apply(c, SystemTime::now()); }
                None => break End::Quit,
            },
            _ = tick.tick() => {
                draw(view, SystemTime::now())?;
                if view.finished() {
                    break End::Finished;
                }
            }
            key = keys.next() => match key {
                Some(Ok(Event::Key(k))) if quits(&k) => break End::Quit,
                Some(Ok(Event::Resize(..))) => draw(view, SystemTime::now())?,
                Some(Err(e)) => return Err(e),
                None => break End::Quit,
                _ => {}
            },
            _ = term.recv() => break End::Quit,
            _ = int.recv() => break End::Quit,
        }
    };
    drop(screen);
    Ok(end)
}

fn quits(k: &KeyEvent) -> bool {
    k.kind == KeyEventKind::Press
        && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc)
            || (k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL)))
}

/// One frame: the whole, a bar for it, the volumes, the keys.
fn draw(view: &View, now: SystemTime) -> std::io::Result<()> {
    let (cols, rows) = terminal::size().unwrap_or((100, 30));
    let width = cols as usize;
    let mut lines = Vec::new();
    match view.summary(now) {
        Some(s) => {
            let mut block =
                render::summary_block(&s, &view.namespace, view.settings.window, now).into_iter();
            lines.extend(block.next());
            let fraction = (s.total_bytes > 0).then(|| s.bytes_done as f64 / s.total_bytes as f64);
            let fraction = if s.finished && s.total_bytes == 0 {
                Some(1.0)
            } else {
                fraction
            };
            let pct = fraction
                .filter(|_| !s.total_at_least)
                .map(|f| format!(" {:.1}%", f * 100.0))
                .unwrap_or_default();
            lines.push(format!(
                "{}{pct}",
                render::bar(fraction, width.saturating_sub(10).min(60))
            ));
            lines.extend(block);
            lines.push(String::new());
            lines.extend(render::volume_rows(&view.items(now), Some(width), true));
        }
        None => lines.push(format!(
            "waiting for {}s labelled {} in namespace {}…",
            view.kind.resource(),
            view.selector,
            view.namespace
        )),
    }
    if let Some(e) = &view.last_error {
        lines.push(String::new());
        lines.push(format!("API: {e} (retrying)"));
    }
    let help = "q or Ctrl-C: quit".to_string();
    let room = (rows as usize).saturating_sub(2);
    lines.truncate(room);
    lines.push(String::new());
    lines.push(help);
    let mut out = std::io::stdout().lock();
    queue!(out, cursor::MoveTo(0, 0))?;
    for l in &lines {
        queue!(
            out,
            style::Print(render::cut(l, width)),
            terminal::Clear(terminal::ClearType::UntilNewLine),
            cursor::MoveToNextLine(1)
        )?;
    }
    queue!(out, terminal::Clear(terminal::ClearType::FromCursorDown))?;
    out.flush()
}
