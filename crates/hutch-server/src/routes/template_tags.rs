//! E2B's template tags: `POST /templates/tags` points tags at the build a `name:tag`
//! names, `DELETE /templates/tags` removes tags, `GET /templates/{id}/tags` lists them;
//! `tags/count`, `tags/exists`, `tags/groups` and `tags/{tag}/assignments` read them and
//! their history.
//! The manager owns who may change them; this only speaks HTTP.

use super::body::{JsonBody, QueryParams};
use crate::auth::KeyId;
use crate::error::ApiError;
use crate::app::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use hutch_core::manager::tags::AssignmentView;
use serde_json::{json, Value};

#[derive(Deserialize)]
pub struct AssignTags {
    /// `name` or `name:tag`: the build the tags will name.
    target: String,
    tags: Vec<String>,
}

#[derive(Deserialize)]
pub struct RemoveTags {
    name: String,
    tags: Vec<String>,
}

/// Tag changes wait for the template's file lock and write with fsync: off the async
/// workers, which serve every other request.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> Result<T, hutch_core::manager::ManagerError> + Send + 'static) -> Result<T, ApiError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => Ok(result?),
        Err(e) => Err(hutch_core::manager::ManagerError::Internal(format!("a tag change's task failed: {e}")).into()),
    }
}

pub async fn assign(State(state): State<AppState>, key: KeyId, JsonBody(body): JsonBody<AssignTags>) -> Result<(StatusCode, Json<Value>), ApiError> {
    let manager = state.manager.clone();
    let (build_id, tags) = blocking(move || manager.assign_template_tags(&key.0, &body.target, &body.tags)).await?;
    Ok((StatusCode::CREATED, Json(json!({ "tags": tags, "buildID": build_id }))))
}

pub async fn remove(State(state): State<AppState>, key: KeyId, JsonBody(body): JsonBody<RemoveTags>) -> Result<StatusCode, ApiError> {
    let manager = state.manager.clone();
    blocking(move || manager.remove_template_tags(&key.0, &body.name, &body.tags)).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn list(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let tags = state.manager.template_tags(&key.0, &id)?;
    Ok(Json(Value::Array(tags.into_iter().map(|t| json!({ "tag": t.tag, "buildID": t.build_id, "createdAt": t.created_at })).collect())))
}

/// `GET /templates/{id}/tags/count`: how many tags it has, `default` included.
pub async fn count(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let tags = state.manager.template_tags(&key.0, &id)?;
    Ok(Json(json!({ "total": tags.len() })))
}

#[derive(Deserialize)]
pub struct ExistsQuery {
    tag: String,
}

/// `GET /templates/{id}/tags/exists?tag=`: whether the tag names a build now.
pub async fn exists(State(state): State<AppState>, key: KeyId, Path(id): Path<String>, QueryParams(q): QueryParams<ExistsQuery>) -> Result<Json<Value>, ApiError> {
    let normal = hutch_core::manager::tags::normal_tag(&q.tag)?;
    let tags = state.manager.template_tags(&key.0, &id)?;
    Ok(Json(json!({ "exists": tags.iter().any(|t| t.tag == normal), "normalizedTag": normal })))
}

fn assignment_json(a: &AssignmentView) -> Value {
    json!({
        "assignmentId": a.assignment_id, "buildId": a.build_id, "assignedAt": a.assigned_at,
        "buildCreatedAt": a.build_created_at, "buildFinishedAt": a.build_finished_at,
    })
}

/// A page size from the query: `default` when absent, else 1 to 100.
fn page_size(what: &str, asked: Option<usize>, default: usize) -> Result<usize, ApiError> {
    match asked.unwrap_or(default) {
        n @ 1..=100 => Ok(n),
        n => Err(ApiError::bad_request(format!("{what} {n} is out of range: ask for 1 to 100"))),
    }
}

/// Where a page starts: a cursor this server handed out (an offset), or the start.
fn page_start(what: &str, cursor: Option<&str>) -> Result<usize, ApiError> {
    cursor.filter(|c| !c.is_empty()).map_or(Ok(0), |c| c.parse().map_err(|_| ApiError::bad_request(format!("{what} '{c}' is not one this server handed out; start without it"))))
}

/// Items `start..start + size` of `all`, and the cursor of the next page if any.
fn page<T>(all: Vec<T>, start: usize, size: usize) -> (Vec<T>, Option<String>) {
    let end = start.saturating_add(size);
    let next = (all.len() > end).then(|| end.to_string());
    (all.into_iter().skip(start).take(size).collect(), next)
}

#[derive(Deserialize)]
pub struct AssignmentsQuery {
    #[serde(default)]
    cursor: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
}

/// `GET /templates/{id}/tags/{tag}/assignments`: the builds the tag named, latest first.
pub async fn assignments(State(state): State<AppState>, key: KeyId, Path((id, tag)): Path<(String, String)>, QueryParams(q): QueryParams<AssignmentsQuery>) -> Result<Json<Value>, ApiError> {
    let tag = hutch_core::manager::tags::normal_tag(&tag)?;
    let (size, start) = (page_size("limit", q.limit, 50)?, page_start("cursor", q.cursor.as_deref())?);
    let mut all: Vec<AssignmentView> = state.manager.tag_assignments(&key.0, &id)?.into_iter().filter(|a| a.tag == tag).collect();
    if all.is_empty() {
        return Err(ApiError::new(StatusCode::NOT_FOUND, format!("template '{id}' has no tag '{tag}'")));
    }
    all.reverse();
    let (data, next) = page(all, start, size);
    Ok(Json(json!({ "data": data.iter().map(assignment_json).collect::<Vec<_>>(), "nextCursor": next })))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupsQuery {
    #[serde(default)]
    assignment_limit: Option<usize>,
    #[serde(default)]
    tags_limit: Option<usize>,
    #[serde(default)]
    tags_cursor: Option<String>,
    #[serde(default)]
    search: Option<String>,
    #[serde(default)]
    sort: Option<String>,
}

/// `GET /templates/{id}/tags/groups`: each tag with its latest assignments, tags
/// filtered by `search` (a substring) and ordered by `sort` (`latest_desc` by default:
/// the tag assigned last first; `latest_asc`, `name_asc`, `name_desc`).
pub async fn groups(State(state): State<AppState>, key: KeyId, Path(id): Path<String>, QueryParams(q): QueryParams<GroupsQuery>) -> Result<Json<Value>, ApiError> {
    let each = page_size("assignmentLimit", q.assignment_limit, 6)?;
    let (size, start) = (page_size("tagsLimit", q.tags_limit, 25)?, page_start("tagsCursor", q.tags_cursor.as_deref())?);
    let sort = q.sort.as_deref().unwrap_or("latest_desc");
    if !["latest_desc", "latest_asc", "name_asc", "name_desc"].contains(&sort) {
        return Err(ApiError::bad_request(format!("sort '{sort}' is not one of latest_desc, latest_asc, name_asc, name_desc")));
    }
    let search = q.search.unwrap_or_default().to_ascii_lowercase();
    // Oldest first, so each tag's group is built latest first by reversing.
    let mut by_tag: std::collections::BTreeMap<String, Vec<AssignmentView>> = Default::default();
    for a in state.manager.tag_assignments(&key.0, &id)?.into_iter().filter(|a| a.tag.contains(&search)) {
        by_tag.entry(a.tag.clone()).or_default().push(a);
    }
    let mut groups: Vec<(String, Vec<AssignmentView>)> = by_tag.into_iter().map(|(t, mut v)| (t, { v.reverse(); v })).collect();
    let latest = |g: &(String, Vec<AssignmentView>)| g.1.first().map(|a| a.assigned_at.clone()).unwrap_or_default();
    match sort {
        "latest_asc" => groups.sort_by_key(|g| (latest(g), g.0.clone())),
        "latest_desc" => groups.sort_by_key(|g| std::cmp::Reverse((latest(g), g.0.clone()))),
        "name_desc" => groups.reverse(),
        _ => {}
    }
    let (groups, next) = page(groups, start, size);
    let tags: Vec<Value> = groups
        .iter()
        .map(|(tag, all)| json!({ "tag": tag, "assignments": all.iter().take(each).map(assignment_json).collect::<Vec<_>>(), "hasMore": all.len() > each }))
        .collect();
    Ok(Json(json!({ "tags": tags, "nextCursor": next })))
}
